"""The suite's shared engines (tests/engines.py) with stand-in engines: a group starts together,
a test waits only for the engines it needs, and each engine stops after its last test."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import pytest

from tests.engines import SharedEngines


@dataclass
class StandInEngine:
    name: str
    events: list[str]
    ready: threading.Event = field(default_factory=threading.Event)
    fails: bool = False

    def wait_ready(self) -> None:
        assert self.ready.wait(timeout=10), f"{self.name} never became ready"
        if self.fails:
            raise RuntimeError(f"{self.name} failed to start")

    def stop(self) -> None:
        self.events.append(f"stop {self.name}")


def shared(events: list[str], engines: dict[str, StandInEngine]) -> SharedEngines:
    def builder(name: str) -> StandInEngine:
        events.append(f"build {name}")
        return engines[name]

    pool = SharedEngines(
        builders={name: (lambda name=name: builder(name)) for name in engines},
        groups=[frozenset({"main", "vllm"})],
    )
    pool.plan(
        [
            ("t1", frozenset({"main"})),
            ("t2", frozenset({"main", "vllm"})),
            ("t3", frozenset({"vllm"})),
            ("t4", frozenset()),
        ]
    )
    return pool


def stand_ins(events: list[str], *names: str) -> dict[str, StandInEngine]:
    return {name: StandInEngine(name, events) for name in names}


def test_a_test_waits_only_for_the_engine_it_needs_while_its_group_keeps_starting() -> None:
    events: list[str] = []
    engines = stand_ins(events, "main", "vllm")
    pool = shared(events, engines)
    engines["main"].ready.set()  # vLLM's server is still starting
    assert pool.get("main", "t1") is engines["main"]
    assert "vllm" in pool.starting and not pool.starting["vllm"].done()
    engines["vllm"].ready.set()
    assert pool.get("vllm", "t2") is engines["vllm"]
    assert events.count("build vllm") == 1  # started once, waited for later
    pool.stop_all()


def test_each_engine_stops_after_its_last_test_and_one_still_starting_is_stopped_too() -> None:
    events: list[str] = []
    engines = stand_ins(events, "main", "vllm")
    pool = shared(events, engines)
    engines["main"].ready.set()
    pool.get("main", "t1")
    pool.release_after("t2")
    assert "stop main" not in events  # t2 needs it
    engines["vllm"].ready.set()
    pool.release_after("t3")
    assert "stop main" in events and "stop vllm" not in events
    pool.release_after("t4")
    assert events[-1] == "stop vllm"
    assert not pool.running and not pool.starting


def test_an_engine_that_fails_to_start_fails_the_test_that_needs_it() -> None:
    events: list[str] = []
    engines = stand_ins(events, "main", "vllm")
    engines["vllm"].fails = True
    pool = shared(events, engines)
    engines["main"].ready.set()
    engines["vllm"].ready.set()
    pool.get("main", "t1")
    with pytest.raises(RuntimeError, match="vllm failed to start"):
        pool.get("vllm", "t2")
    assert "stop vllm" in events  # what it had started is stopped
    pool.stop_all()
    assert events.count("stop main") == 1


def test_an_engine_stopped_after_its_last_test_hands_its_place_to_its_successors() -> None:
    events: list[str] = []
    engines = stand_ins(events, "main", "vllm", "lora")
    pool = SharedEngines(
        builders={name: (lambda name=name: engines[name]) for name in engines},
        successors={"vllm": frozenset({"lora"})},
    )
    pool.plan(
        [
            ("t1", frozenset({"vllm"})),
            ("t2", frozenset({"main"})),  # the adapter stack starts while this one runs
            ("t3", frozenset({"lora"})),
        ]
    )
    for engine in engines.values():
        engine.ready.set()
    pool.get("vllm", "t1")
    pool.release_after("t2")
    assert events == ["stop vllm"]
    assert "lora" in pool.starting
    pool.get("main", "t2")
    assert pool.get("lora", "t3") is engines["lora"]
    pool.release_after("t3")
    assert events == ["stop vllm", "stop main"]
    pool.stop_all()
