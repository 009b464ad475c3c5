"""service/model/adapter_registry.py on a recording stand-in engine: leases and the drains they
hold up, drain deadlines, least-recently-used eviction and waiting for a busy slot, path
confinement, versions by content; and the CPU stand-in built from a model's weights."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from service.model import adapter_files, adapter_registry, cpu_lora_fix
from service.model.adapter_checks import (
    AdapterInvalidError,
    AdapterNameTakenError,
    AdapterNotFoundError,
)
from service.model.adapter_registry import (
    AdapterCapacityError,
    AdapterFromRootError,
    AdapterOutsideRootError,
    AdapterRegistry,
)
from service.model.adapters import ModelCatalog, UnknownModelError
from service.settings import EngineSettings

BASE = "base-model"


class RecordingEngine:
    """Takes adapters as the engine would, recording what is in its memory."""

    def __init__(self) -> None:
        self.held: dict[int, str] = {}
        self.vllm_config = SimpleNamespace(lora_config=None)
        self.model_config = SimpleNamespace(max_model_len=512)

    async def add_lora(self, request: Any) -> bool:
        self.held[request.lora_int_id] = request.lora_name
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        return self.held.pop(lora_id, None) is not None


def write_adapter(directory: Path, model: Path, seed: float = 1.0, rank: int = 8) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 16,
        "target_modules": ["q_proj"],
        "base_model_name_or_path": str(model),
    }
    (directory / "adapter_config.json").write_text(json.dumps(config))
    weights = {"q_proj.lora_A.weight": torch.full((rank, 4), seed)}
    save_file(weights, directory / "adapter_model.safetensors")
    return directory


@pytest.fixture
def model(tmp_path: Path) -> Path:
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return directory


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "root").mkdir()
    return tmp_path / "root"


def registry(
    model: Path, root: Path, tmp_path: Path, **settings: Any
) -> tuple[AdapterRegistry, RecordingEngine]:
    engine = RecordingEngine()
    config = EngineSettings(None, BASE, adapter_root=root, enable_adapter_loading=True, **settings)
    made = AdapterRegistry(engine, ModelCatalog(BASE), config, model, tmp_path / "scratch")  # type: ignore[arg-type]
    return made, engine


def test_the_base_model_is_no_adapter_and_an_unknown_name_is_unknown(
    model: Path, root: Path, tmp_path: Path
) -> None:
    served, _ = registry(model, root, tmp_path)

    async def scenario() -> None:
        assert (await served.acquire(BASE)).request is None
        with pytest.raises(UnknownModelError):
            await served.acquire("nope")
        with pytest.raises(UnknownModelError):
            await served.acquire("../root")

    asyncio.run(scenario())


def test_an_unload_waits_for_the_calls_holding_the_adapter_and_refuses_new_ones(
    model: Path, root: Path, tmp_path: Path
) -> None:
    served, engine = registry(model, root, tmp_path)
    write_adapter(root / ".staging" / "a", model)

    async def scenario() -> None:
        version = await served.load("a", str(root / ".staging" / "a"))
        lease = await served.acquire("a")
        assert engine.held == {version.request.lora_int_id: "a"}
        unloading = asyncio.ensure_future(served.unload("a", drain_seconds=30))
        await asyncio.sleep(0.05)
        assert not unloading.done()
        with pytest.raises(UnknownModelError):
            await served.acquire("a")
        assert engine.held  # still there: a call runs on it
        lease.release()
        await asyncio.wait_for(unloading, 5)
        assert engine.held == {}
        assert version.snapshot is not None and not version.snapshot.exists()

    asyncio.run(scenario())


def test_past_the_drain_deadline_the_calls_are_ended_naming_the_unload(
    model: Path, root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(adapter_registry, "ENDED_CALLS_GRACE_SECONDS", 0.05)
    served, engine = registry(model, root, tmp_path)
    write_adapter(root / ".staging" / "a", model)
    reasons: list[str] = []

    async def end_call(reason: str) -> None:
        reasons.append(reason)

    async def scenario() -> None:
        await served.load("a", str(root / ".staging" / "a"))
        await served.acquire("a", end_call)
        await asyncio.wait_for(served.unload("a", drain_seconds=0.05), 5)
        assert reasons == ["adapter `a` was unloaded while this call ran"]
        assert engine.held == {}

    asyncio.run(scenario())


def test_the_least_recently_used_idle_adapter_makes_room(
    model: Path, root: Path, tmp_path: Path
) -> None:
    served, engine = registry(model, root, tmp_path, max_loras=2)  # two slots
    for name in ("a", "b", "c"):
        write_adapter(root / name, model, seed=ord(name))

    async def scenario() -> None:
        for name in ("a", "b", "a", "c"):  # b is the least recently used when c comes
            (await served.acquire(name)).release()
        assert sorted(engine.held.values()) == ["a", "c"]
        assert served.resident_names() == ["a", "c"]

    asyncio.run(scenario())


def test_a_call_waits_while_every_slot_runs_calls_and_gives_up_in_time(
    model: Path, root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    served, engine = registry(model, root, tmp_path, max_loras=1, max_cpu_loras=1)
    for name in ("a", "b"):
        write_adapter(root / name, model, seed=ord(name))

    async def scenario() -> None:
        held = await served.acquire("a")
        waiting = asyncio.ensure_future(served.acquire("b"))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        held.release()
        (await asyncio.wait_for(waiting, 5)).release()
        assert list(engine.held.values()) == ["b"]
        monkeypatch.setattr(adapter_registry, "SLOT_WAIT_SECONDS", 0.05)
        await served.acquire("b")
        with pytest.raises(AdapterCapacityError, match="--max-cpu-loras"):
            await served.acquire("a")

    asyncio.run(scenario())


def test_load_paths_must_resolve_inside_the_root(model: Path, root: Path, tmp_path: Path) -> None:
    served, _ = registry(model, root, tmp_path)
    outside = write_adapter(tmp_path / "outside", model)
    (root / ".link").symlink_to(outside)

    async def scenario() -> None:
        for path in (str(outside), str(root / ".link"), "relative/dir", str(root / "..")):
            with pytest.raises(AdapterOutsideRootError):
                await served.load("x", path)
        with pytest.raises(AdapterNotFoundError):
            await served.load("x", str(root / "missing"))

    asyncio.run(scenario())


def test_names_taken_and_root_adapters_are_refused_as_such(
    model: Path, root: Path, tmp_path: Path
) -> None:
    served, _ = registry(model, root, tmp_path)
    write_adapter(root / "from-root", model)
    staged = str(write_adapter(root / ".staging" / "a", model))

    other = str(write_adapter(root / ".staging" / "other", model, seed=2.0))

    async def scenario() -> None:
        first = await served.load("a", staged)
        assert await served.load("a", staged) is first  # the same load again: done already
        for name in (BASE, "a", "from-root"):
            with pytest.raises(AdapterNameTakenError):
                await served.load(name, other)
        with pytest.raises(AdapterFromRootError):
            await served.unload("from-root", 1)
        with pytest.raises(AdapterNotFoundError):
            await served.unload("never", 1)

    asyncio.run(scenario())


def test_an_adapter_over_the_rank_or_byte_cap_is_refused(
    model: Path, root: Path, tmp_path: Path
) -> None:
    served, _ = registry(model, root, tmp_path, max_adapter_bytes=100_000)
    wide = str(write_adapter(root / ".staging" / "wide", model, rank=32))
    big = write_adapter(root / ".staging" / "big", model)
    (big / "padding").write_bytes(bytes(200_000))

    async def scenario() -> None:
        with pytest.raises(AdapterInvalidError, match="raise --max-lora-rank to at least 32"):
            await served.load("wide", wide)
        with pytest.raises(AdapterCapacityError, match="--max-adapter-bytes"):
            await served.load("big", str(big))

    asyncio.run(scenario())


def test_a_changed_root_adapter_is_a_new_version_and_a_removed_one_is_retired(
    model: Path, root: Path, tmp_path: Path
) -> None:
    served, engine = registry(model, root, tmp_path)
    write_adapter(root / "a", model, seed=1.0)

    async def scenario() -> None:
        first = await served.acquire("a")
        first.release()
        write_adapter(root / "a", model, seed=2.0)  # new weights under the same name
        await served.sync_root()
        second = await served.acquire("a")
        second.release()
        assert first.request and second.request
        assert first.request.lora_int_id != second.request.lora_int_id
        await asyncio.gather(*served.retiring)
        assert list(engine.held) == [second.request.lora_int_id]
        (root / "a" / "adapter_config.json").unlink()
        await served.sync_root()
        await asyncio.gather(*served.retiring)
        assert engine.held == {} and "a" not in served.names

    asyncio.run(scenario())


def test_a_version_is_named_by_its_files_and_its_name(tmp_path: Path) -> None:
    first = adapter_files.engine_id("a", adapter_files.digest(write_files(tmp_path / "1", b"x")))
    same = adapter_files.engine_id("a", adapter_files.digest(write_files(tmp_path / "2", b"x")))
    other = adapter_files.engine_id("a", adapter_files.digest(write_files(tmp_path / "3", b"y")))
    renamed = adapter_files.engine_id("b", adapter_files.digest(write_files(tmp_path / "4", b"x")))
    assert first == same and len({first, other, renamed}) == 3
    assert first > 1_000_000  # above the ids of the adapters given at start


def write_files(directory: Path, content: bytes) -> Path:
    directory.mkdir()
    (directory / "weights").write_bytes(content)
    return directory


def test_the_cpu_stand_in_is_built_from_the_model_weights_all_zero(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    save_file(
        {
            "model.embed_tokens.weight": torch.ones(10, 6),
            "model.layers.0.self_attn.q_proj.weight": torch.ones(6, 6),
        },
        model / "model.safetensors",
    )
    target = cpu_lora_fix.write_model_zero_adapter(model, tmp_path / "stand-in", rank=8)
    config = json.loads((target / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["target_modules"]) == ("LORA", 8, ["q_proj"])
    with safe_open(str(target / "adapter_model.safetensors"), framework="pt") as weights:
        prefix = "base_model.model.model.layers.0.self_attn.q_proj"
        a, b = (
            weights.get_tensor(f"{prefix}.lora_A.weight"),
            weights.get_tensor(f"{prefix}.lora_B.weight"),
        )
    assert a.shape == (8, 6) and b.shape == (6, 8)
    assert not a.any() and not b.any()


def test_names_and_paths_no_file_system_takes_are_unknown_not_errors(
    model: Path, root: Path, tmp_path: Path
) -> None:
    served, _ = registry(model, root, tmp_path)

    async def scenario() -> None:
        for name in ("m" * 100_000, "nul\0name", ".hidden", "a/b", ""):
            assert not served.serves(name)
            with pytest.raises(UnknownModelError):
                await served.acquire(name)
        for path in (str(root / ("p" * 5000)), f"{root}/nul\0path"):
            with pytest.raises(AdapterNotFoundError):
                await served.load("x", path)

    asyncio.run(scenario())
