"""LoRA adapters served by name on the base model: the names the server answers to, a
request's `model` resolved to its adapter, and the adapters checked before the engine starts
(a bad one fails start-up with one line naming it, not the first request for it)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

from vllm.config.lora import MaxLoRARanks
from vllm.lora.request import LoRARequest
from vllm.v1.engine.async_llm import AsyncLLM

from service.model import cpu_lora_fix
from service.model.default_model import model_directory
from service.settings import EngineSettings, LoraModule

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


# The rank of the base model's stand-in when no adapter is given at start (any rank serves).
STAND_IN_RANK = 8


class AdapterError(Exception):
    """An adapter that cannot be served; the message, one line, names it."""


class AdapterNotFoundError(AdapterError):
    """The adapter's directory, or a file it needs, does not exist."""


class AdapterInvalidError(AdapterError):
    """Not an adapter this engine can serve on this model (its kind, rank or base model)."""


class AdapterNameTakenError(AdapterError):
    """The name is the base model's or another adapter's."""


class UnknownModelError(LookupError):
    """A name that is neither the base model's nor an adapter's."""


def quote(name: str) -> str:
    return f"`{name}`"


@dataclass(frozen=True)
class ModelCatalog:
    """The served names: the base model's, then each adapter's."""

    base: str
    adapters: Mapping[str, LoRARequest] = field(default_factory=dict)
    # Stands in for "no adapter" on engines whose LoRA ops mishandle it (cpu_lora_fix).
    base_adapter: LoRARequest | None = None

    @property
    def names(self) -> list[str]:
        """Every name a request's `model` may be, the base model's first."""
        return [self.base, *self.adapters]

    def engine_adapters(self) -> list[LoRARequest]:
        """Every adapter the engine loads, the stand-in for the base model included."""
        extra = [self.base_adapter] if self.base_adapter is not None else []
        return [*self.adapters.values(), *extra]


def lora_requests(modules: Sequence[LoraModule]) -> dict[str, LoRARequest]:
    """Each adapter's engine request, by name; ids from 1 in the order given."""
    return {
        module.name: LoRARequest(module.name, index, str(module.path))
        for index, module in enumerate(modules, start=1)
    }


def build_catalog(settings: EngineSettings, scratch: Path) -> ModelCatalog:
    """The served names; on engines with vLLM's CPU LoRA bug, the base model's stand-in
    adapter is written into `scratch`."""
    adapters = lora_requests(settings.lora_modules)
    base_adapter = None
    if settings.lora_enabled and cpu_lora_fix.needed():
        base_adapter = LoRARequest(
            f"{settings.served_model_name} (no adapter)",
            len(adapters) + 1,
            str(write_stand_in(settings, scratch / "base")),
        )
    return ModelCatalog(settings.served_model_name, adapters, base_adapter)


def write_stand_in(settings: EngineSettings, target: Path) -> Path:
    """The all-zero adapter base-model requests run with (cpu_lora_fix): a copy of the first
    adapter given, else one built from the model's weights."""
    if settings.lora_modules:
        return cpu_lora_fix.write_zero_adapter(settings.lora_modules[0].path, target)
    rank = min(STAND_IN_RANK, settings.max_lora_rank)
    return cpu_lora_fix.write_model_zero_adapter(model_directory(settings.model), target, rank)


def check_adapters(
    modules: Sequence[LoraModule], max_lora_rank: int, model_dir: Path, served_name: str
) -> None:
    """Refuse, with an AdapterError, adapters the engine could not serve on this model."""
    allowed_ranks = get_args(MaxLoRARanks)
    if modules and max_lora_rank not in allowed_ranks:
        raise AdapterError(
            f"--max-lora-rank {max_lora_rank} is not one vLLM supports: "
            f"{', '.join(map(str, allowed_ranks))}"
        )
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


async def load_adapters(engine: AsyncLLM, catalog: ModelCatalog) -> None:
    """Load every adapter into the engine now, so that one vLLM cannot read fails start-up."""
    for request in catalog.engine_adapters():
        try:
            await engine.add_lora(request)
        except Exception as error:
            reason = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
            raise AdapterError(
                f"adapter {quote(request.lora_name)}: the engine could not load "
                f"{request.lora_path}: {reason}"
            ) from error
