"""Where the engine runs: core lists, their split over the engine's workers, the environment
vLLM reads, and the warning when automatic binding would share cores with another engine."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from service.model import placement
from service.model.placement import PlacementError, binding, parse_core_list, place_engine

FOUR = {0, 1, 2, 3}


@pytest.mark.parametrize(
    ("text", "cores"),
    [("0", (0,)), ("0-3", (0, 1, 2, 3)), ("0,2", (0, 2)), ("0-1, 3", (0, 1, 3))],
)
def test_core_lists(text: str, cores: tuple[int, ...]) -> None:
    assert parse_core_list(text, FOUR) == cores


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("a", "not a list of cores"),
        ("1-", "not a list of cores"),
        ("3-1", "empty range"),
        ("0,0", "names a core twice"),
        ("2-5", "cores [4, 5] are not available here (this process may use 0,1,2,3)"),
    ],
)
def test_bad_core_lists_say_why(text: str, said: str) -> None:
    with pytest.raises(PlacementError, match=re.escape(said)):
        parse_core_list(text, FOUR)


def test_cores_are_split_evenly_over_the_engines_workers() -> None:
    assert binding((0, 1, 2, 3), 1) == "0,1,2,3"
    assert binding((0, 1, 2, 3), 2) == "0,1|2,3"
    with pytest.raises(PlacementError, match="evenly over 2"):
        binding((0, 1, 2), 2)


def fake_proc(root: Path, processes: dict[int, str]) -> Path:
    for pid, name in processes.items():
        (root / str(pid)).mkdir()
        (root / str(pid) / "comm").write_text(name + "\n")
    (root / "self").mkdir()
    return root


def test_other_engines_are_found_by_their_process_names(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, {10: "VLLM::Worker", 11: "VLLM::EngineCor", 12: "python"})
    assert placement.other_engines(proc) == [10, 11]


def test_explicit_cores_reach_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(placement.CPU_BIND_ENV, raising=False)
    place_engine((1,), None, ranks=1, on_cpu=True)
    assert placement.os.environ[placement.CPU_BIND_ENV] == "1"


def test_gpu_devices_reach_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(placement.DEVICES_ENV, raising=False)
    place_engine((), "2,3", ranks=1, on_cpu=False)
    assert placement.os.environ[placement.DEVICES_ENV] == "2,3"


@pytest.mark.parametrize("others", [[], [4242]])
def test_automatic_binding_warns_beside_another_engine(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, others: list[int]
) -> None:
    monkeypatch.delenv(placement.CPU_BIND_ENV, raising=False)
    monkeypatch.setattr(placement, "other_engines", lambda: others)
    with caplog.at_level(logging.INFO, logger=placement.__name__):
        place_engine((), None, ranks=1, on_cpu=True)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == len(others)
    if others:
        assert "4242" in warnings[0].getMessage() and "--cpu-cores" in warnings[0].getMessage()
