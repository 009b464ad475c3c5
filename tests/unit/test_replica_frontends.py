"""Several frontends over one engine, without a model: the backlog bounds counted over every
frontend, the cancel fan-out's verdicts, the ports, and the lines and metrics that say which
frontend served."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import socket
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from llmcompletions.v2.completions_pb2 import (
    CancelCompletionRequest,
    CancelCompletionResponse,
    LoadLoraAdapterRequest,
    LoadLoraAdapterResponse,
)
from vllm.v1.engine.admission_control import SharedAdmissionStats

from facade.stack import Stack
from plumbing.headers import ATTEMPT_COUNT_HEADER, FANOUT_CONTINUE, FANOUT_HEADER
from plumbing.ports import frontend_ports
from service.api.backlog import Backlog, ReplicaTally
from service.api.errors import CancelForbiddenError, CancelTargetNotFoundError, OverloadedError
from service.options import frontend_ports_problem
from service.settings import ServerSettings
from service.transport import request_context
from service.transport.logs import FrontendField, PlainFormatter
from service.transport.observability import InteractiveCalls, RequestRecord
from service.transport.replica import check_ports_free
from service.transport.servicer import CompletionServicer
from service.transport.siblings import FORWARDED_HEADER, is_forwarded
from tests.unit.test_capacity import CAPACITY, Engine

FRONTENDS = 2


def shared_memory() -> tuple[list[int], list[int]]:
    """vLLM's admission counters and the replica's tally, as the parent makes them."""
    spawn = multiprocessing.get_context("spawn")
    admission = spawn.RawArray("q", SharedAdmissionStats.num_counters(FRONTENDS))
    tally = spawn.RawArray("q", ReplicaTally.FIELDS * FRONTENDS)
    return admission, tally  # type: ignore[return-value]


def frontend(index: int, admission: list[int], tally: list[int]) -> tuple[Backlog, Engine]:
    engine = Engine(CAPACITY)
    engine.admission_stats = SharedAdmissionStats(
        {"mp_admission_counters": admission}, FRONTENDS, index
    )
    return Backlog(engine, CAPACITY, ReplicaTally(tally, FRONTENDS, index)), engine  # type: ignore[arg-type]


def test_sequences_held_by_one_frontend_refuse_a_call_on_the_other() -> None:
    admission, tally = shared_memory()
    _first, first_engine = frontend(0, admission, tally)
    second, _ = frontend(1, admission, tally)
    first_engine.admission_stats.set_num_requests(7)  # as vLLM does when requests come and go
    second.check(3)  # 7 + 3 = 10: at the bound
    with pytest.raises(OverloadedError) as refused:
        second.check(4)
    assert "7 sequences are waiting or running" in refused.value.message
    with pytest.raises(OverloadedError):
        second.admit(4)  # vLLM's own check reads the same counters


def test_calls_in_preparation_on_one_frontend_count_on_the_other() -> None:
    admission, tally = shared_memory()
    first, _ = frontend(0, admission, tally)
    second, _ = frontend(1, admission, tally)
    with first.preparing(8), pytest.raises(OverloadedError):
        second.check(3)
    second.check(3)  # published again when the preparation ended


def test_queued_tokens_of_both_frontends_make_the_token_bound() -> None:
    admission, tally = shared_memory()
    first, first_engine = frontend(0, admission, tally)
    second, second_engine = frontend(1, admission, tally)
    first_engine.queued_tokens, second_engine.queued_tokens = 60, 30
    first.publish()
    second.check(1)  # 90 < 100
    second_engine.queued_tokens = 40  # 100 with the first's: the bound
    with pytest.raises(OverloadedError) as refused:
        second.check(1)
    assert "reached the bound of 100" in refused.value.message
    with pytest.raises(OverloadedError):
        second.admit(1)  # vLLM's check sees only its own 40; the replica's count refuses


def test_a_batch_job_in_one_frontend_sees_the_interactive_calls_of_the_other() -> None:
    """Each frontend publishes its interactive calls in the replica's tally, which a batch
    runner in either reads; alone (no tally), a frontend counts its own."""
    _, tally = shared_memory()
    first = InteractiveCalls(tally=ReplicaTally(tally, FRONTENDS, 0))
    second = InteractiveCalls(tally=ReplicaTally(tally, FRONTENDS, 1))
    second.add(1)
    second.add(1)
    assert (first.running, first.in_replica()) == (0, 2)
    first.add(1)
    second.add(-2)
    assert (first.in_replica(), second.in_replica()) == (1, 1)
    alone = InteractiveCalls()
    alone.add(1)
    assert alone.in_replica() == 1


def test_one_frontend_alone_counts_as_before() -> None:
    engine = Engine(CAPACITY)
    alone = Backlog(engine, CAPACITY)  # type: ignore[arg-type]
    engine.unfinished, engine.queued_tokens = 9, 10
    assert alone.held() == (9, 10)
    alone.publish()  # nothing to share: no error


class Siblings:
    """The other frontends' answers to a forwarded cancel."""

    def __init__(self, done: Sequence[int], codes: Sequence[grpc.StatusCode]) -> None:
        self.done, self.codes = done, codes
        self.asked: list[tuple[tuple[str, str | bytes], ...]] = []

    async def cancel(
        self, request: CancelCompletionRequest, metadata: Sequence[tuple[str, str | bytes]]
    ) -> tuple[list[CancelCompletionResponse], list[grpc.StatusCode]]:
        self.asked.append(tuple(metadata))
        replies = [CancelCompletionResponse(cancelled=count) for count in self.done]
        return replies, list(self.codes)


def verdict(siblings: Siblings, here: Exception) -> int:
    servicer = CompletionServicer(lambda: None, siblings)  # type: ignore[arg-type]
    request = CancelCompletionRequest(request_id="r1")
    metadata = (("authorization", "Bearer k"),)
    return asyncio.run(servicer.cancel_in_siblings(request, metadata, here))  # type: ignore[arg-type]


def test_a_cancel_the_owner_frontend_performed_counts_its_calls() -> None:
    codes = [grpc.StatusCode.NOT_FOUND]
    assert verdict(Siblings([2], codes), CancelTargetNotFoundError("r1")) == 2


def test_a_cancel_no_frontend_holds_is_not_found_and_anothers_call_is_forbidden() -> None:
    missing = CancelTargetNotFoundError("r1")
    with pytest.raises(CancelTargetNotFoundError):
        verdict(Siblings([], [grpc.StatusCode.NOT_FOUND]), missing)
    with pytest.raises(CancelForbiddenError):
        verdict(Siblings([], [grpc.StatusCode.PERMISSION_DENIED]), missing)
    forbidden_here = CancelForbiddenError("r1")
    with pytest.raises(CancelForbiddenError):
        verdict(Siblings([], [grpc.StatusCode.NOT_FOUND]), forbidden_here)


def test_a_forwarded_cancel_is_marked_and_not_forwarded_again() -> None:
    assert is_forwarded(((FORWARDED_HEADER, "cancel"),))
    assert not is_forwarded((("authorization", "Bearer k"),))


def test_frontend_ports_follow_the_replicas_port_unless_given() -> None:
    assert frontend_ports(50051, 2) == (50052, 50053)
    assert frontend_ports(50051, 2, (7001, 7002)) == (7001, 7002)
    assert ServerSettings(port=9000, api_server_count=3).own_ports() == (9001, 9002, 9003)


@pytest.mark.parametrize(
    ("settings", "problem"),
    [
        (ServerSettings(api_server_count=2, frontend_ports=(7001,)), "one per frontend"),
        (ServerSettings(port=7001, api_server_count=2, frontend_ports=(7001, 7002)), "differ"),
        (ServerSettings(api_server_count=2, frontend_ports=(7001, 7001)), "differ"),
        (ServerSettings(api_server_count=2), None),
        (ServerSettings(api_server_count=1, frontend_ports=(7001, 7002)), None),
    ],
)
def test_frontend_ports_are_one_per_frontend_and_distinct(
    settings: ServerSettings, problem: str | None
) -> None:
    found = frontend_ports_problem(settings)
    assert (found is None) if problem is None else (problem in (found or ""))


def test_a_taken_port_stops_the_replica_before_it_starts() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        settings = ServerSettings(port=port - 1, api_server_count=1, frontend_ports=(port,))
        with pytest.raises(SystemExit, match=f"127.0.0.1:{port}: is the port in use"):
            check_ports_free(settings)


def test_a_port_left_in_time_wait_by_a_drained_replica_is_free_again() -> None:
    """A listener whose side closed its connection first (a drain does) leaves that connection
    in TIME_WAIT on the port for a minute: a plain bind fails there, gRPC's (SO_REUSEADDR)
    succeeds, and so does the check."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = listener.accept()
        accepted.close()  # the server's side first: its end goes to TIME_WAIT
        client.recv(1)
        client.close()
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind(("127.0.0.1", port))
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        own_port = unused.getsockname()[1]
    settings = ServerSettings(port=port, api_server_count=1, frontend_ports=(own_port,))
    check_ports_free(settings)  # no SystemExit


def test_every_line_of_a_frontend_names_it() -> None:
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "serving", None, None)
    record.fields = {"status": "OK"}
    FrontendField(1).filter(record)
    assert PlainFormatter().format(record).endswith("serving status='OK' frontend=1")


def test_envoy_balances_over_each_frontends_port(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FRONTEND_PORTS", raising=False)
    assert Stack(grpc_port=50051, env={"API_SERVER_COUNT": "1"}).upstream_targets == [
        "127.0.0.1:50051"
    ]
    several = Stack(grpc_port=50051, env={"API_SERVER_COUNT": "2"})
    assert several.upstream_targets == ["127.0.0.1:50052", "127.0.0.1:50053"]
    given = Stack(grpc_port=50051, env={"API_SERVER_COUNT": "2", "FRONTEND_PORTS": "7001,7002"})
    assert given.upstream_replica == "127.0.0.1:7001+7002"


class AdapterAdminStandIn:
    """Counts the loads it does."""

    drain_seconds = 1.0

    def __init__(self) -> None:
        self.loads = 0

    async def load(self, request: LoadLoraAdapterRequest) -> LoadLoraAdapterResponse:
        self.loads += 1
        return LoadLoraAdapterResponse(lora_name=request.lora_name, object="lora_adapter.loaded")


class Context:
    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.metadata = metadata

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata


def fanout_attempt(
    servicer: CompletionServicer, attempt: int, fanout: bool = True
) -> tuple[LoadLoraAdapterResponse, tuple[tuple[str, str], ...]]:
    """One of Envoy's attempts of the load with request id r1: the reply and its headers."""
    record = RequestRecord("r1", "LoadLoraAdapter", "sql", "", stream=False)
    token = request_context._current.set(record)
    marks = ((FANOUT_HEADER, "1"), (ATTEMPT_COUNT_HEADER, str(attempt))) if fanout else ()
    try:
        reply = asyncio.run(
            servicer.LoadLoraAdapter(
                LoadLoraAdapterRequest(lora_name="sql", lora_path="/root/sql"),
                Context(marks),  # type: ignore[arg-type]
            )
        )
    finally:
        request_context._current.reset(token)
    return reply, record.reply_headers


def test_envoys_fanout_counts_each_replica_and_ends_at_one_asked_again() -> None:
    """Two replicas: attempt 1 on the first, 2 on the second, 3 on the first again."""
    admins = [AdapterAdminStandIn(), AdapterAdminStandIn()]
    servicers = [
        CompletionServicer(lambda admin=admin: SimpleNamespace(adapters=admin))  # type: ignore[misc]
        for admin in admins
    ]
    first, headers = fanout_attempt(servicers[0], 1)
    assert first.replicas == 1 and (FANOUT_HEADER, FANOUT_CONTINUE) in headers
    second, headers = fanout_attempt(servicers[1], 2)
    assert second.replicas == 2 and (FANOUT_HEADER, FANOUT_CONTINUE) in headers
    last, headers = fanout_attempt(servicers[0], 3)
    assert (last.replicas, last.object, headers) == (2, "lora_adapter.loaded", ())
    assert [admin.loads for admin in admins] == [1, 1]  # each did it once
    direct, headers = fanout_attempt(servicers[1], 1, fanout=False)
    assert (direct.replicas, headers) == (0, ())  # not through Envoy: no count, no "next"


class SiblingStandIn:
    """The other frontend of a replica of two: a forwarded load is done there."""

    def __init__(self) -> None:
        self.channels = [None]
        self.other: CompletionServicer | None = None

    async def each(
        self, method: str, request: Any, metadata: Any, timeout: float
    ) -> list[grpc.aio.AioRpcError]:
        assert self.other is not None
        done = await self.other.serving().adapters.load(request)
        self.other.fanouts.done[(request_context.current_record().request_id, method)] = done
        return []


def test_envoys_fanout_counts_replicas_of_two_frontends_once_each() -> None:
    """Two replicas of two frontends, each frontend an endpoint of Envoy's: the first frontend
    asked does the load and its sibling with it; the count is of replicas."""
    admins = [AdapterAdminStandIn() for _ in range(4)]
    links = [SiblingStandIn() for _ in range(4)]
    servicers = [
        CompletionServicer(lambda admin=admin: SimpleNamespace(adapters=admin), link)  # type: ignore[misc, arg-type]
        for admin, link in zip(admins, links, strict=True)
    ]
    for first, second in ((0, 1), (2, 3)):  # frontends of one replica
        links[first].other, links[second].other = servicers[second], servicers[first]
    counts = [
        fanout_attempt(servicers[frontend], attempt)[0].replicas
        for attempt, frontend in enumerate((0, 1, 2, 3), start=1)
    ]
    assert counts == [1, 1, 2, 2]
    last, headers = fanout_attempt(servicers[1], 5)  # asked again: every endpoint was
    assert (last.replicas, headers) == (2, ())
    assert [admin.loads for admin in admins] == [1, 1, 1, 1]  # each frontend's table, once
