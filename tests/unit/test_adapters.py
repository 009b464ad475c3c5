"""service/model/adapters.py, adapter_checks.py and cpu_lora_fix.py: the served names and how
a request's `model` resolves, the start-up checks on hand-written adapter directories, the
engine's LoRA arguments, and the vLLM CPU bug the workaround exists for."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from vllm.lora.request import LoRARequest

from service.api.endpoint_models import check_served
from service.api.errors import MAX_MESSAGE_BYTES, ModelNotFoundError
from service.model import cpu_lora_fix
from service.model.adapter_checks import AdapterError, check_adapters, same_base
from service.model.adapter_registry import AdapterRegistry
from service.model.adapters import (
    ModelCatalog,
    build_catalog,
    check_max_lora_rank,
    lora_requests,
)
from service.model.engine import lora_args
from service.settings import EngineSettings, LoraModule

BASE = "smollm2-135m-instruct"
ARCHITECTURE = {"model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30}


def model_dir(root: Path, name: str = BASE, **config: Any) -> Path:
    directory = root / name
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({**ARCHITECTURE, **config}))
    return directory


def adapter_dir(root: Path, name: str, base: str | None, rank: int = 8, **extra: Any) -> Path:
    directory = root / name
    directory.mkdir(parents=True)
    config = {"peft_type": "LORA", "r": rank, "base_model_name_or_path": base, **extra}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    save_file(
        {"q_proj.lora_A.weight": torch.ones(rank, 4), "q_proj.lora_B.weight": torch.ones(4, rank)},
        directory / "adapter_model.safetensors",
    )
    return directory


def check(modules: list[LoraModule], model: Path, max_rank: int = 16) -> None:
    check_adapters(modules, max_rank, model, BASE)


# ---- names and resolution


def catalog(*names: str) -> ModelCatalog:
    return ModelCatalog(BASE, lora_requests([LoraModule(n, Path(f"/a/{n}")) for n in names]))


def registry(*names: str) -> AdapterRegistry:
    settings = EngineSettings(None, BASE)
    return AdapterRegistry(None, catalog(*names), settings, Path("/"), Path("/"))  # type: ignore[arg-type]


def test_names_are_the_base_then_the_adapters_in_order() -> None:
    assert registry("sql", "chat").names == [BASE, "sql", "chat"]
    assert registry("sql", "chat").serves("chat")


def test_the_stand_in_is_no_served_name() -> None:
    stand_in = LoRARequest("base (no adapter)", 2, "/scratch/base")
    served = ModelCatalog(BASE, catalog("sql").adapters, stand_in)
    assert served.engine_adapters() == [served.adapters["sql"], stand_in]
    assert served.names == [BASE, "sql"]


def test_an_unknown_name_is_not_found_listing_the_served_names() -> None:
    with pytest.raises(ModelNotFoundError) as caught:
        check_served(registry("sql", "chat"), "nope")
    assert caught.value.message == (
        f"The model `nope` does not exist; the served models are `{BASE}`, `sql`, `chat`."
    )


def test_the_not_found_message_stays_bounded_with_many_adapters() -> None:
    names = [f"adapter-{index:04d}" for index in range(2000)]
    with pytest.raises(ModelNotFoundError) as caught:
        check_served(registry(*names), "x" * 10_000)
    message = caught.value.message
    assert len(message.encode()) <= MAX_MESSAGE_BYTES
    assert f"`{BASE}`" in message and "more" in message


# ---- start-up checks


def test_a_good_adapter_passes(tmp_path: Path) -> None:
    model = model_dir(tmp_path)
    good = adapter_dir(tmp_path, "good", str(model))
    check([LoraModule("good", good)], model)


def test_a_missing_directory_is_refused_naming_the_adapter(tmp_path: Path) -> None:
    with pytest.raises(AdapterError, match=r"^adapter `gone`: .*does not exist"):
        check([LoraModule("gone", tmp_path / "gone")], model_dir(tmp_path))


def test_a_directory_without_weights_is_refused(tmp_path: Path) -> None:
    model = model_dir(tmp_path)
    empty = adapter_dir(tmp_path, "empty", str(model))
    (empty / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match=r"^adapter `empty`: no adapter_model"):
        check([LoraModule("empty", empty)], model)


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"peft_type": "IA3", "r": 8}'])
def test_an_unreadable_or_foreign_config_is_refused(tmp_path: Path, text: str) -> None:
    model = model_dir(tmp_path)
    odd = adapter_dir(tmp_path, "odd", str(model))
    (odd / "adapter_config.json").write_text(text)
    with pytest.raises(AdapterError, match=r"^adapter `odd`"):
        check([LoraModule("odd", odd)], model)


def test_a_rank_over_the_maximum_is_refused_with_both_numbers(tmp_path: Path) -> None:
    model = model_dir(tmp_path)
    wide = adapter_dir(tmp_path, "wide", str(model), rank=32)
    with pytest.raises(AdapterError) as caught:
        check([LoraModule("wide", wide)], model, max_rank=16)
    assert str(caught.value) == (
        "adapter `wide` has rank 32, over --max-lora-rank 16; raise --max-lora-rank to at least 32"
    )


def test_a_rank_pattern_counts_toward_the_rank(tmp_path: Path) -> None:
    model = model_dir(tmp_path)
    mixed = adapter_dir(tmp_path, "mixed", str(model), rank=8, rank_pattern={"v_proj": 64})
    with pytest.raises(AdapterError, match="rank 64"):
        check([LoraModule("mixed", mixed)], model, max_rank=16)


def test_a_max_lora_rank_vllm_does_not_support_is_refused() -> None:
    check_max_lora_rank(16)
    with pytest.raises(AdapterError, match="--max-lora-rank 10 is not one vLLM supports"):
        check_max_lora_rank(10)


def test_another_base_model_is_refused_naming_both(tmp_path: Path) -> None:
    model = model_dir(tmp_path)
    other = adapter_dir(tmp_path, "other", "meta-llama/Llama-3.2-1B")
    with pytest.raises(AdapterError) as caught:
        check([LoraModule("other", other)], model)
    assert "adapter `other` was trained on `meta-llama/Llama-3.2-1B`" in str(caught.value)
    assert str(model) in str(caught.value)


@pytest.mark.parametrize("name", [BASE, "dup"])
def test_names_must_be_unique_and_not_the_base_models(tmp_path: Path, name: str) -> None:
    model = model_dir(tmp_path)
    one = adapter_dir(tmp_path, "one", str(model))
    modules = [LoraModule(name, one), LoraModule("dup", one)]
    with pytest.raises(AdapterError, match=f"adapter `{name}`: the name is taken"):
        check(modules, model)


def test_same_base_by_directory_architecture_or_hub_id(tmp_path: Path) -> None:
    served = model_dir(tmp_path)
    copy = model_dir(tmp_path / "copies", "renamed-copy")
    different = model_dir(tmp_path / "other", "bigger", hidden_size=2048)
    assert same_base(str(served), served)
    assert same_base(str(copy), served)  # the same architecture elsewhere
    assert not same_base(str(different), served)
    assert same_base("HuggingFaceTB/SmolLM2-135M-Instruct", served)  # the id names the dir
    assert not same_base("HuggingFaceTB/SmolLM2-360M-Instruct", served)


def test_an_adapter_without_a_declared_base_passes(tmp_path: Path) -> None:
    model = model_dir(tmp_path)
    anonymous = adapter_dir(tmp_path, "anonymous", None)
    check([LoraModule("anonymous", anonymous)], model)


# ---- the engine's arguments and the base model's stand-in


def test_no_adapters_no_lora_arguments() -> None:
    settings = EngineSettings(model=None, served_model_name=BASE)
    assert lora_args(settings, ModelCatalog(BASE)) == {}


@pytest.mark.parametrize(("stand_in", "extra"), [(False, 0), (True, 1)])
def test_lora_arguments_count_a_slot_for_the_stand_in(stand_in: bool, extra: int) -> None:
    modules = tuple(LoraModule(name, Path(f"/a/{name}")) for name in ("a", "b", "c"))
    settings = EngineSettings(
        model=None, served_model_name=BASE, lora_modules=modules, max_loras=2, max_lora_rank=32
    )
    base = LoRARequest("base", 4, "/scratch") if stand_in else None
    served = ModelCatalog(BASE, lora_requests(modules), base)
    assert lora_args(settings, served) == {
        "enable_lora": True,
        "max_loras": 2 + extra,
        "max_lora_rank": 32,
        "max_cpu_loras": 3 + extra,
    }


def test_target_modules_reach_the_engine_only_when_given() -> None:
    modules = (LoraModule("a", Path("/a/a")),)
    settings = EngineSettings(
        model=None, served_model_name=BASE, lora_modules=modules, lora_target_modules=("q_proj",)
    )
    assert lora_args(settings, ModelCatalog(BASE, lora_requests(modules)))[
        "lora_target_modules"
    ] == ["q_proj"]
    untargeted = EngineSettings(model=None, served_model_name=BASE, lora_modules=modules)
    assert "lora_target_modules" not in lora_args(untargeted, ModelCatalog(BASE))


def test_the_stand_in_is_the_first_adapter_with_every_weight_zero(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpu_lora_fix, "needed", lambda: True)
    first = adapter_dir(tmp_path, "first", None)
    second = adapter_dir(tmp_path, "second", None)
    modules = (LoraModule("first", first), LoraModule("second", second))
    settings = EngineSettings(model=None, served_model_name=BASE, lora_modules=modules)
    served = build_catalog(settings, tmp_path / "scratch")
    stand_in = served.base_adapter
    assert stand_in is not None and stand_in.lora_int_id == 3
    path = Path(stand_in.lora_path)
    assert (path / "adapter_config.json").read_text() == (first / "adapter_config.json").read_text()
    weights = load_file(path / "adapter_model.safetensors")
    original = load_file(first / "adapter_model.safetensors")
    assert weights.keys() == original.keys()
    for name, tensor in weights.items():
        assert tensor.shape == original[name].shape and not tensor.any()


def test_no_stand_in_where_the_engine_has_no_bug(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpu_lora_fix, "needed", lambda: False)
    modules = (LoraModule("first", adapter_dir(tmp_path, "first", None)),)
    settings = EngineSettings(model=None, served_model_name=BASE, lora_modules=modules)
    assert build_catalog(settings, tmp_path / "scratch").base_adapter is None


def test_vllms_cpu_lora_op_still_applies_the_last_adapter_without_one() -> None:
    """The bug service/model/cpu_lora_fix.py works around (vLLM 0.32.0, CPU build). When this
    fails, the installed vLLM has the fix (vllm-project/vllm#48421 or #49656): the
    workaround has switched itself off; delete service/model/cpu_lora_fix.py, its use in
    service/model/adapters.py and its section of docs/operating/adapters.md."""
    assert cpu_lora_fix.lora_op_applies_last_slot_without_adapter()
    assert cpu_lora_fix.needed()  # this is the CPU build
