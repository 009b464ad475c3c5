"""An adapter's modules checked against the engine's LoRA target modules
(--lora-target-modules): vLLM loads an adapter whose weights fall outside them and silently
ignores those weights, so that adapter would answer as another model. It is refused instead,
with the modules named."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from safetensors import SafetensorError, safe_open
from vllm.config import VllmConfig
from vllm.lora.utils import is_in_target_modules, parse_fine_tuned_lora_name
from vllm.model_executor.models.registry import ModelRegistry

from service.model.adapter_checks import (
    ADAPTER_WEIGHTS,
    AdapterInvalidError,
    adapter_config,
    quote,
)
from service.settings import LoraModule

SAFETENSORS_WEIGHTS = ADAPTER_WEIGHTS[0]


@dataclass(frozen=True)
class TargetModules:
    """The modules the engine gives LoRA layers, by their last name, and the served model's
    packed modules (`qkv_proj` is q, k and v), which a target may name either way."""

    names: tuple[str, ...]
    packed: Mapping[str, list[str]] = field(default_factory=dict)

    def covers(self, module: str) -> bool:
        return is_in_target_modules(module, list(self.names), dict(self.packed))

    def check(self, adapter: LoraModule) -> None:
        """Refuse, with an AdapterInvalidError, an adapter that changes a module without a
        LoRA layer in this engine."""
        outside = sorted(name for name in adapter_modules(adapter) if not self.covers(name))
        if outside:
            raise AdapterInvalidError(
                f"adapter {quote(adapter.name)} changes {', '.join(outside)}, which this "
                f"server gives no LoRA layer (--lora-target-modules {','.join(self.names)}): "
                "its weights there would be ignored; add them to --lora-target-modules"
            )


def engine_targets(config: VllmConfig) -> TargetModules | None:
    """The engine's LoRA target modules; None where LoRA is off or covers every module."""
    lora = config.lora_config
    if lora is None or lora.target_modules is None:
        return None
    model = config.model_config
    model_class, _ = ModelRegistry.resolve_model_cls(model.architectures, model)
    packed = getattr(model_class, "packed_modules_mapping", None) or {}
    return TargetModules(tuple(lora.target_modules), dict(packed))


def adapter_modules(adapter: LoraModule) -> set[str]:
    """The modules an adapter changes, by their last name: its weights' names where they are
    safetensors, else the list its config declares (PEFT's target_modules)."""
    weights = adapter.path / SAFETENSORS_WEIGHTS
    if weights.is_file():
        try:
            with safe_open(str(weights), framework="pt") as tensors:
                keys = list(tensors.keys())
        except (OSError, SafetensorError) as error:
            raise AdapterInvalidError(
                f"adapter {quote(adapter.name)}: cannot read {weights}: {error}"
            ) from None
        return {name.rsplit(".", 1)[-1] for name in map(lora_module_name, keys) if name}
    declared = adapter_config(adapter).get("target_modules")
    if isinstance(declared, list) and all(isinstance(name, str) for name in declared):
        return {name.rsplit(".", 1)[-1] for name in declared}
    raise AdapterInvalidError(
        f"adapter {quote(adapter.name)}: the modules it changes cannot be told (no "
        f"{SAFETENSORS_WEIGHTS}, and its config's target_modules is not a list), and this "
        "server gives LoRA layers only to --lora-target-modules"
    )


def lora_module_name(weight: str) -> str | None:
    """The module a LoRA weight belongs to, as vLLM names it; None for a weight that is not
    LoRA's (vLLM's own checks refuse those that it cannot serve)."""
    try:
        return parse_fine_tuned_lora_name(weight)[0]
    except ValueError:
        return None
