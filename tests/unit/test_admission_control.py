"""service/transport/admission.py: at most max_in_flight requests run, at most max_waiting wait, the
rest are refused at once with RESOURCE_EXHAUSTED and a retry hint."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import pytest
from prometheus_client import REGISTRY

from service.transport.admission import Admission, OverloadedError


@contextlib.asynccontextmanager
async def admitted(admission: Admission) -> AsyncIterator[None]:
    """Hold a slot for the duration. Admission is being reshaped while this is written: the
    committed API is the `slot()` context manager, the one in progress `enter()`/`leave()`
    (for an interceptor); these tests check the behaviour, whichever API carries it."""
    if hasattr(admission, "slot"):
        async with admission.slot():
            yield
        return
    await admission.enter()
    try:
        yield
    finally:
        admission.leave()


def waiting() -> float:
    """Requests waiting for a slot, as the metrics endpoint reports them."""
    return REGISTRY.get_sample_value("llmcompletions_requests_waiting") or 0.0


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), timeout=10))


class Traffic:
    """Requests holding their slot until released, recording what happened to each."""

    def __init__(self, admission: Admission) -> None:
        self.admission = admission
        self.running: set[str] = set()
        self.done: list[str] = []
        self.refused: list[OverloadedError] = []
        self.release: dict[str, asyncio.Event] = {}
        self.tasks: dict[str, asyncio.Task] = {}

    def start(self, name: str) -> asyncio.Task:
        self.release[name] = asyncio.Event()
        self.tasks[name] = asyncio.create_task(self.request(name))
        return self.tasks[name]

    async def request(self, name: str) -> None:
        try:
            async with admitted(self.admission):
                self.running.add(name)
                try:
                    await self.release[name].wait()
                finally:
                    self.running.discard(name)
                    self.done.append(name)
        except OverloadedError as error:
            self.refused.append(error)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_requests_beyond_in_flight_wait_and_beyond_waiting_are_refused() -> None:
    async def scenario() -> None:
        traffic = Traffic(Admission(max_in_flight=2, max_waiting=1))
        for name in "abcd":
            traffic.start(name)
        await settle()
        assert traffic.running == {"a", "b"}
        assert waiting() == 1  # "c"
        assert len(traffic.refused) == 1 and traffic.tasks["d"].done()  # refused at once
        traffic.release["a"].set()
        await settle()
        assert traffic.running == {"b", "c"}
        assert waiting() == 0
        traffic.start("e")  # there is room to wait again
        await settle()
        assert waiting() == 1 and len(traffic.refused) == 1
        for event in traffic.release.values():
            event.set()
        await asyncio.gather(*traffic.tasks.values())
        assert sorted(traffic.done) == ["a", "b", "c", "e"]

    run(scenario)


def test_the_refusal_says_why_and_when_to_retry() -> None:
    async def scenario() -> None:
        traffic = Traffic(Admission(max_in_flight=1, max_waiting=0))
        traffic.start("a")
        traffic.start("b")
        await settle()
        (error,) = traffic.refused
        assert error.grpc_code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert error.metadata() == (("retry-after", "1"),)
        assert "1 requests in flight" in error.message and "0 waiting" in error.message
        assert "retry after 1s" in error.message
        traffic.release["a"].set()
        await asyncio.gather(*traffic.tasks.values())

    run(scenario)


def test_a_free_slot_is_taken_without_waiting() -> None:
    async def scenario() -> None:
        admission = Admission(max_in_flight=3, max_waiting=0)
        async with admitted(admission), admitted(admission), admitted(admission):
            assert waiting() == 0
            with pytest.raises(OverloadedError):
                async with admitted(admission):
                    pass
        async with admitted(admission):  # all three came back
            pass

    run(scenario)


def test_a_failing_request_gives_its_slot_back() -> None:
    async def scenario() -> None:
        admission = Admission(max_in_flight=1, max_waiting=0)
        with pytest.raises(RuntimeError):
            async with admitted(admission):
                raise RuntimeError("handler failed")
        async with admitted(admission):
            pass

    run(scenario)


def test_a_cancelled_waiter_frees_its_place_in_the_queue() -> None:
    async def scenario() -> None:
        traffic = Traffic(Admission(max_in_flight=1, max_waiting=1))
        traffic.start("a")
        waiter = traffic.start("b")
        await settle()
        assert waiting() == 1
        waiter.cancel()
        await settle()
        assert waiting() == 0
        traffic.start("c")  # takes the freed place instead of being refused
        await settle()
        assert traffic.refused == [] and waiting() == 1
        traffic.release["a"].set()
        traffic.release["c"].set()
        await asyncio.gather(traffic.tasks["a"], traffic.tasks["c"])
        assert traffic.done == ["a", "c"]

    run(scenario)


def test_the_waiting_gauge_follows_the_queue() -> None:
    async def scenario() -> None:
        start = waiting()
        traffic = Traffic(Admission(max_in_flight=1, max_waiting=5))
        for name in "abc":
            traffic.start(name)
        await settle()
        assert waiting() == start + 2
        for event in traffic.release.values():
            event.set()
        await asyncio.gather(*traffic.tasks.values())
        assert waiting() == start

    run(scenario)
