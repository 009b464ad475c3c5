"""service/model/adapter_targets.py: an adapter changing a module the engine gives no LoRA
layer (--lora-target-modules) is refused, naming the module; one within them passes, by its
own name or its packed module's."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from vllm.lora.request import LoRARequest

from service.model.adapter_checks import AdapterInvalidError
from service.model.adapter_targets import TargetModules, adapter_modules, engine_targets
from service.model.adapters import ModelCatalog, load_adapters, lora_requests
from service.settings import LoraModule

LLAMA_PACKED = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
}


def weight_name(module: str, half: str) -> str:
    block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
    return f"base_model.model.model.layers.0.{block}.{module}.lora_{half}.weight"


def adapter(
    root: Path, modules: tuple[str, ...], declared: Any = None, bin_only: bool = False
) -> LoraModule:
    """A PEFT adapter directory whose weights change `modules` of layer 0."""
    directory = root / "adapter"
    directory.mkdir()
    config = {"peft_type": "LORA", "r": 2, "target_modules": declared or list(modules)}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    weights = {weight_name(m, half): torch.ones(2, 2) for m in modules for half in "AB"}
    if bin_only:
        torch.save(weights, directory / "adapter_model.bin")
    else:
        save_file(weights, directory / "adapter_model.safetensors")
    return LoraModule("sql", directory)


def test_the_modules_are_read_from_the_weights_names(tmp_path: Path) -> None:
    # The config may declare more than the weights hold (PEFT skips modules a model lacks).
    made = adapter(tmp_path, ("q_proj", "down_proj"), declared=["q_proj", "down_proj", "w9"])
    assert adapter_modules(made) == {"q_proj", "down_proj"}


def test_without_safetensors_the_configs_list_is_read(tmp_path: Path) -> None:
    made = adapter(tmp_path, ("q_proj", "v_proj"), bin_only=True)
    assert adapter_modules(made) == {"q_proj", "v_proj"}


def test_without_safetensors_a_pattern_cannot_be_told_and_is_refused(tmp_path: Path) -> None:
    made = adapter(tmp_path, ("q_proj",), declared="all-linear", bin_only=True)
    with pytest.raises(AdapterInvalidError, match="cannot be told"):
        adapter_modules(made)


@pytest.mark.parametrize(
    "targets", [("q_proj", "v_proj"), ("qkv_proj",), ("v_proj", "q_proj", "o_proj")]
)
def test_an_adapter_within_the_targets_passes(tmp_path: Path, targets: tuple[str, ...]) -> None:
    TargetModules(targets, LLAMA_PACKED).check(adapter(tmp_path, ("q_proj", "v_proj")))


def test_an_adapter_outside_the_targets_is_refused_naming_the_modules(tmp_path: Path) -> None:
    made = adapter(tmp_path, ("q_proj", "o_proj", "gate_proj"))
    with pytest.raises(AdapterInvalidError) as refused:
        TargetModules(("q_proj", "v_proj"), LLAMA_PACKED).check(made)
    assert str(refused.value) == (
        "adapter `sql` changes gate_proj, o_proj, which this server gives no LoRA layer "
        "(--lora-target-modules q_proj,v_proj): its weights there would be ignored; add them "
        "to --lora-target-modules"
    )


def config(target_modules: list[str] | None, lora: bool = True) -> Any:
    model = SimpleNamespace(
        architectures=["LlamaForCausalLM"], model_impl="auto", convert_type="none"
    )
    lora_config = SimpleNamespace(target_modules=target_modules) if lora else None
    return SimpleNamespace(lora_config=lora_config, model_config=model)


def test_the_engines_targets_carry_the_served_models_packed_modules() -> None:
    assert engine_targets(config(None)) is None
    assert engine_targets(config(None, lora=False)) is None
    targets = engine_targets(config(["qkv_proj"]))
    assert targets is not None and targets.packed["qkv_proj"] == ["q_proj", "k_proj", "v_proj"]
    assert targets.covers("v_proj") and not targets.covers("o_proj")


def test_weights_that_are_not_loras_are_left_to_vllms_checks(tmp_path: Path) -> None:
    made = adapter(tmp_path, ("q_proj",))
    weights = made.path / "adapter_model.safetensors"
    extra = {"base_model.model.lm_head.weight": torch.ones(2, 2)}
    save_file({**extra, weight_name("q_proj", "A"): torch.ones(2, 2)}, weights)
    assert adapter_modules(made) == {"q_proj"}


def test_unreadable_weights_are_refused_naming_the_file(tmp_path: Path) -> None:
    made = adapter(tmp_path, ("q_proj",))
    (made.path / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(
        AdapterInvalidError, match=r"`sql`: cannot read .*adapter_model\.safetensors"
    ):
        adapter_modules(made)


def test_a_start_with_an_adapter_outside_the_targets_loads_nothing(tmp_path: Path) -> None:
    made = adapter(tmp_path, ("q_proj", "o_proj"))
    loaded: list[str] = []

    async def add_lora(request: LoRARequest) -> None:
        loaded.append(request.lora_name)

    engine = SimpleNamespace(vllm_config=config(["q_proj", "v_proj"]), add_lora=add_lora)
    catalog = ModelCatalog("base", lora_requests([made]))
    with pytest.raises(AdapterInvalidError, match="`sql` changes o_proj"):
        asyncio.run(load_adapters(engine, catalog))  # type: ignore[arg-type]
    assert loaded == []
    engine.vllm_config = config(["qkv_proj", "o_proj"])
    asyncio.run(load_adapters(engine, catalog))  # type: ignore[arg-type]
    assert loaded == ["sql"]
