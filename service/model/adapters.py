"""LoRA adapters served by name on the base model: the names the server answers to, a
request's `model` resolved to its adapter, the rank limit checked against vLLM's, and the
adapters loaded before the server serves (their files: service/model/adapter_checks.py)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import get_args

from vllm.config.lora import MaxLoRARanks
from vllm.lora.request import LoRARequest
from vllm.v1.engine.async_llm import AsyncLLM

from service.model import cpu_lora_fix
from service.model.adapter_checks import AdapterError, quote
from service.model.adapter_targets import engine_targets
from service.model.default_model import model_directory
from service.settings import EngineSettings, LoraModule

# The rank of the base model's stand-in when no adapter is given at start (any rank serves).
STAND_IN_RANK = 8


class UnknownModelError(LookupError):
    """A name that is neither the base model's nor an adapter's."""


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


def check_max_lora_rank(max_lora_rank: int) -> None:
    """Refuse, with an AdapterError, a --max-lora-rank vLLM does not support."""
    allowed_ranks = get_args(MaxLoRARanks)
    if max_lora_rank not in allowed_ranks:
        raise AdapterError(
            f"--max-lora-rank {max_lora_rank} is not one vLLM supports: "
            f"{', '.join(map(str, allowed_ranks))}"
        )


async def load_adapters(engine: AsyncLLM, catalog: ModelCatalog) -> None:
    """Load every adapter into the engine now, so that one vLLM cannot read, or one that
    changes modules the engine gives no LoRA layer, fails start-up."""
    if (targets := engine_targets(engine.vllm_config)) is not None:
        for name, request in catalog.adapters.items():
            targets.check(LoraModule(name, Path(request.lora_path)))
    for request in catalog.engine_adapters():
        try:
            await engine.add_lora(request)
        except Exception as error:
            reason = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
            raise AdapterError(
                f"adapter {quote(request.lora_name)}: the engine could not load "
                f"{request.lora_path}: {reason}"
            ) from error
