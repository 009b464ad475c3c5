"""A tiny random-weight model with the default model's architecture and tokenizer.

On a CPU host the real model's engine costs about 20 CPU-ms per token, which hides the serving
path; with one narrow layer the engine is cheap and the frontend's CPU per token shows.
Built once in seconds from the default model's config, cached beside it.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from service.model.default_model import exclusive_lock, prepare_default_model

NUM_LAYERS = 1
HIDDEN_SIZE = 64
INTERMEDIATE_SIZE = 256
# head_dim 32 is the smallest head size vLLM's CPU attention backend supports.
NUM_ATTENTION_HEADS = 2
NUM_KEY_VALUE_HEADS = 1
HEAD_DIM = HIDDEN_SIZE // NUM_ATTENTION_HEADS
SEED = 0
COMPLETE_MARKER = "tiny.json"
# Copied as they are from the default model: the tokenizer, its chat template, generation.
COPIED_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
)


def tiny_settings() -> dict[str, object]:
    return {
        "num_hidden_layers": NUM_LAYERS,
        "hidden_size": HIDDEN_SIZE,
        "intermediate_size": INTERMEDIATE_SIZE,
        "num_attention_heads": NUM_ATTENTION_HEADS,
        "num_key_value_heads": NUM_KEY_VALUE_HEADS,
        "head_dim": HEAD_DIM,
    }


def tiny_model_dir(default_dir: Path) -> Path:
    name = (
        f"{default_dir.name}-random-l{NUM_LAYERS}-h{HIDDEN_SIZE}-i{INTERMEDIATE_SIZE}"
        f"-a{NUM_ATTENTION_HEADS}kv{NUM_KEY_VALUE_HEADS}-s{SEED}"
    )
    return default_dir.parent / name


def prepare_tiny_model() -> Path:
    """Return the tiny model's directory, building it first if it is missing."""
    default_dir = prepare_default_model()
    return built_once(default_dir, tiny_model_dir(default_dir), COMPLETE_MARKER, build)


def built_once(
    default_dir: Path, target: Path, marker: str, build: Callable[[Path, Path], None]
) -> Path:
    """`target`, built from the default model by `build` unless `marker` in it says it is
    whole already: once, whichever of several processes asks first."""
    if (target / marker).is_file():
        return target
    with exclusive_lock(target.parent / f".{target.name}.lock"):
        if not (target / marker).is_file():  # another process may have built it
            build(default_dir, target)
    return target


def build(default_dir: Path, target: Path) -> None:
    """Seeded random float32 weights saved with the default model's tokenizer, atomically."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    print(f"tiny model: building {target.name} from {default_dir.name}'s config", flush=True)
    config = AutoConfig.from_pretrained(default_dir)
    for key, value in tiny_settings().items():
        setattr(config, key, value)
    transformers_logging.disable_progress_bar()  # the line above is the progress shown
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".tiny-") as scratch:
        work = Path(scratch) / "model"
        model.save_pretrained(work, safe_serialization=True)
        for name in COPIED_FILES:
            if (default_dir / name).is_file():
                shutil.copy2(default_dir / name, work / name)
        (work / COMPLETE_MARKER).write_text(json.dumps({**tiny_settings(), "seed": SEED}))
        if target.exists():
            shutil.rmtree(target)
        work.rename(target)


if __name__ == "__main__":
    print(prepare_tiny_model())
