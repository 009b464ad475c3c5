"""LoRA adapters' files checked before the engine starts: an adapter that cannot be served
(missing, not LoRA, over the rank allowed, trained on another model, or under a name already
taken) fails start-up with one line naming it. Only the files are read, nothing of vLLM is
imported, so a bad adapter fails at once rather than after the engine's imports."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from service.settings import LoraModule

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
# What makes two model directories the same model to an adapter: its layers' shapes and names.
ARCHITECTURE_KEYS = (
    "model_type",
    "architectures",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
)


class AdapterError(Exception):
    """An adapter that cannot be served; the message, one line, names it."""


class AdapterNotFoundError(AdapterError):
    """The adapter's directory, or a file it needs, does not exist."""


class AdapterInvalidError(AdapterError):
    """Not an adapter this engine can serve on this model (its kind, rank or base model)."""


class AdapterNameTakenError(AdapterError):
    """The name is the base model's or another adapter's."""


def quote(name: str) -> str:
    return f"`{name}`"


def check_adapters(
    modules: Sequence[LoraModule], max_lora_rank: int, model_dir: Path, served_name: str
) -> None:
    """Refuse, with an AdapterError, adapters the engine could not serve on this model."""
    names = [module.name for module in modules]
    for module in modules:
        if module.name == served_name or names.count(module.name) > 1:
            raise AdapterNameTakenError(
                f"adapter {quote(module.name)}: the name is taken (by the base model or "
                "another adapter); each served name must be unique"
            )
        check_adapter(module, max_lora_rank, model_dir)


def check_adapter(module: LoraModule, max_lora_rank: int, model_dir: Path) -> None:
    config = adapter_config(module)
    if not any((module.path / name).is_file() for name in ADAPTER_WEIGHTS):
        raise AdapterNotFoundError(
            f"adapter {quote(module.name)}: no {' or '.join(ADAPTER_WEIGHTS)} in {module.path}"
        )
    rank = adapter_rank(module, config)
    if rank > max_lora_rank:
        raise AdapterInvalidError(
            f"adapter {quote(module.name)} has rank {rank}, over --max-lora-rank "
            f"{max_lora_rank}; raise --max-lora-rank to at least {rank}"
        )
    declared = config.get("base_model_name_or_path")
    if declared and not same_base(str(declared), model_dir):
        raise AdapterInvalidError(
            f"adapter {quote(module.name)} was trained on {quote(declared)}, not on the served "
            f"model {quote(model_dir)}"
        )


def adapter_config(module: LoraModule) -> dict[str, Any]:
    path = module.path / ADAPTER_CONFIG
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise AdapterNotFoundError(
            f"adapter {quote(module.name)}: {path} does not exist (--lora-modules takes "
            "NAME=DIR, DIR a PEFT adapter directory)"
        ) from None
    except (OSError, ValueError) as error:
        raise AdapterInvalidError(
            f"adapter {quote(module.name)}: cannot read {path}: {error}"
        ) from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise AdapterInvalidError(
            f"adapter {quote(module.name)}: {path} is not a LoRA adapter's config"
        )
    return config


def adapter_rank(module: LoraModule, config: dict[str, Any]) -> int:
    """The largest rank of the adapter's modules (PEFT's `rank_pattern` overrides `r`)."""
    ranks = [config.get("r"), *(config.get("rank_pattern") or {}).values()]
    if not all(isinstance(rank, int) and rank > 0 for rank in ranks):
        raise AdapterInvalidError(f"adapter {quote(module.name)}: its config has no valid rank `r`")
    return max(ranks)


def same_base(declared: str, model_dir: Path) -> bool:
    """Whether an adapter's base model (a directory or a Hugging Face id) is the served model.
    A directory is if it is the same directory or has the same architecture; an id is if its
    last part names the model directory (ignoring case), e.g. `HuggingFaceTB/SmolLM2-135M`
    for a directory `smollm2-135m`."""
    declared_path = Path(declared).expanduser()
    if declared_path.is_dir():
        if declared_path.resolve() == model_dir.resolve():
            return True
        theirs = architecture(declared_path)
        return theirs is not None and theirs == architecture(model_dir)
    return declared.rstrip("/").rsplit("/", 1)[-1].lower() == model_dir.resolve().name.lower()


def architecture(model_dir: Path) -> dict[str, Any] | None:
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return {key: config.get(key) for key in ARCHITECTURE_KEYS}
