"""The engines the real-process suite starts, in one place.

Starting an engine is the suite's largest cost (about 50 s on a 2-core host: three processes
each importing torch and vLLM), so every configuration is declared here with the number of
times a whole run may start it (START_BUDGET), and the session's summary shows how many times
each was started and fails the run past its budget. tests/unit/test_engine_budget.py checks
statically that every start names one of these and that no two places build the same engine.

Shared engines (SHARED) serve every test that needs that configuration: each is started once,
those of a group together (their imports run side by side on the host's cores, and a test
waits only for the ones it needs: the rest keep starting while it runs), and stopped as soon
as no test left in the session needs it, so that few are alive at once. A test gets its own
engine only where it stops, kills, restarts or reconfigures it."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

logger = logging.getLogger(__name__)

# Start-ups a whole run may make, by configuration, and why each is its own.
START_BUDGET: dict[str, int] = {
    # Shared for the session.
    "main": 1,  # the default stack (conftest): 2048-token context, keys, chat flags, faults
    "vllm": 1,  # vLLM's own OpenAI server on the same model: the parity baseline
    "lora": 1,  # ours with two adapters, under a name of its own: adapters, pools
    "vllm-lora": 1,  # vLLM's server with the same adapters: adapter parity
    "fleet": 2,  # two replicas on their own cores, traced: routing, tracing, engine death
    "small": 1,  # batch of 4, priority, small backlog bounds, a BOS tokenizer: capacity, lifecycle
    "vlm": 1,  # ours on the tiny vision-language model, with media bounds: images
    "vllm-vlm": 1,  # vLLM's server on the same model and media settings: image parity
    # One module's own, each stopped, killed, restarted or reconfigured by its tests.
    "tls": 1,  # serves TLS and requires client certificates
    # Two replicas on one batch root, each SIGKILLed mid-job in turn, then one started again.
    "batch-resume": 3,
    # Two replicas joining a fresh Envoy under traffic, one drained and restarted.
    "multi-replica": 3,
    # Stopped at four moments of its start, by SIGTERM and by SIGKILL; and with two frontends
    # at one of them.
    "lifetime": 10,
    "image": 1,  # the image's install, started as the image starts it
    # Two replicas following one adapter root: adapters across a fleet. Not the fleet's own:
    # a replica that can load adapters runs base-model calls 1.6-3.5 times slower on vLLM's CPU
    # build, and the routing tests on the fleet are base-model calls (about 2 minutes more).
    "adapter-fleet": 2,
    # Two frontends over one engine core: one shared by the module (its last test drains it
    # and starts it again on the same ports), one whose frontend is killed, one whose engine
    # core is.
    "frontends": 4,
}


class Engine(Protocol):
    """A started engine configuration: one server or several."""

    def wait_ready(self) -> None: ...

    def stop(self) -> None: ...


@dataclass
class Starts:
    """Every engine start-up of the session, by configuration."""

    counts: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, name: str, servers: int = 1) -> None:
        if name not in START_BUDGET:
            raise AssertionError(f"engine {name!r} is not declared in tests/engines.py")
        with self.lock:
            self.counts[name] += servers

    def over_budget(self) -> dict[str, tuple[int, int]]:
        return {
            name: (count, START_BUDGET[name])
            for name, count in self.counts.items()
            if count > START_BUDGET[name]
        }

    def summary(self) -> list[str]:
        total = sum(self.counts.values())
        lines = [f"engine start-ups: {total} (budget {sum(START_BUDGET.values())})"]
        lines += [
            f"  {name}: {self.counts[name]} of {budget}"
            for name, budget in START_BUDGET.items()
            if self.counts[name]
        ]
        return lines


STARTS = Starts()


@dataclass
class SharedEngines:
    """The shared engines: built by `builders` (each records its own start-up), started when a
    test first needs one (with the rest of its group that tests still need, which a test that
    does not need them does not wait for), and stopped once no remaining test needs them."""

    builders: dict[str, Callable[[], Engine]]
    groups: Sequence[frozenset[str]] = ()
    # Engines that must be running before another starts (what its tests observe needs them).
    requires: dict[str, frozenset[str]] = field(default_factory=dict)
    # Engines started (those still needed) as soon as another stops, in its place: they start
    # while the tests before their first run, instead of that test waiting for them.
    successors: dict[str, frozenset[str]] = field(default_factory=dict)
    running: dict[str, Engine] = field(default_factory=dict)
    # Started and not yet waited for: each ready (or failed) when its future is done.
    starting: dict[str, Future[Engine]] = field(default_factory=dict)
    # For each test of the session, in order: the shared engines it and the tests after it need.
    needed_from: list[frozenset[str]] = field(default_factory=list)
    position: dict[str, int] = field(default_factory=dict)
    starter: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(thread_name_prefix="engine-start")
    )

    def plan(self, needs: Sequence[tuple[str, frozenset[str]]]) -> None:
        """The session's tests in order, each (its id, the shared engines it needs)."""
        self.position = {test_id: index for index, (test_id, _) in enumerate(needs)}
        later: frozenset[str] = frozenset()
        needed_from = []
        for _, engines in reversed(needs):
            later = later | self.with_required(engines)
            needed_from.append(later)
        self.needed_from = list(reversed(needed_from))

    def with_required(self, engines: frozenset[str]) -> frozenset[str]:
        required = frozenset().union(*(self.requires.get(name, ()) for name in engines))
        return engines | (self.with_required(required) if required - engines else required)

    def still_needed(self, test_id: str | None) -> frozenset[str]:
        if test_id is None or test_id not in self.position:
            return frozenset(self.builders) if test_id is not None else frozenset()
        return self.needed_from[self.position[test_id]]

    def get(self, name: str, test_id: str) -> Engine:
        for required in sorted(self.requires.get(name, ())):
            self.get(required, test_id)
        if name not in self.running and name not in self.starting:
            self.start({name} | self.group_of(name) & self.still_needed(test_id))
        if name in self.starting:
            self.running[name] = self.starting.pop(name).result()
        return self.running[name]

    def group_of(self, name: str) -> frozenset[str]:
        return next((group for group in self.groups if name in group), frozenset())

    def start(self, names: Iterable[str]) -> None:
        """Starts building the engines side by side: each is in `starting` until a test waits
        for it."""
        wanted = sorted(set(names) - set(self.running) - set(self.starting))
        if not wanted:
            return
        logger.info("starting shared engines: %s", ", ".join(wanted))
        for name in wanted:
            self.starting[name] = self.starter.submit(self.bring_up, name)

    def bring_up(self, name: str) -> Engine:
        """Builds an engine and waits until it is ready; stops what it started if it fails."""
        engine = self.builders[name]()
        try:
            engine.wait_ready()
        except BaseException:
            engine.stop()
            raise
        return engine

    def release_after(self, next_test_id: str | None) -> None:
        """Stops the engines that no test from `next_test_id` on needs."""
        if next_test_id is None:
            return  # the session's end stops the rest
        needed = self.still_needed(next_test_id)
        for name in sorted(set(self.running) | set(self.starting)):
            if name not in needed:
                logger.info("stopping shared engine %s: no test left needs it", name)
                self.stop(name)
                if successors := self.successors.get(name, frozenset()) & needed:
                    self.start(successors)

    def stop(self, name: str) -> None:
        if name in self.starting:
            try:
                self.running[name] = self.starting.pop(name).result()
            except Exception:
                return  # it failed to start, and stopped what it had started
        self.running.pop(name).stop()

    def stop_all(self) -> None:
        for name in [*self.running, *self.starting]:
            self.stop(name)
