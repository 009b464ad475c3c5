"""When the engine process dies: requests in flight get errors promptly, health turns
NOT_SERVING, new requests get UNAVAILABLE, and the server exits non-zero for its supervisor."""

from __future__ import annotations

import threading
import time

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from llmcompletions.v2 import completions_pb2_grpc

from tests.conftest import MODEL, FleetReplicas
from tests.helpers import grpc_request
from tests.processes import TestStack

ERROR_WITHIN_SECONDS = 10
EXIT_WITHIN_SECONDS = 60


@pytest.fixture(scope="module")
def service(fleet_replicas: FleetReplicas) -> TestStack:
    """A replica of the session's fleet still running (the routing tests kill the other): its
    engine dies here, and the replica with it."""
    return fleet_replicas.alive()[0]


def engine_core(pid: int) -> psutil.Process:
    children = psutil.Process(pid).children(recursive=True)
    return next(p for p in children if "EngineCore" in " ".join([p.name(), *p.cmdline()]))


def test_engine_death_fails_fast_and_exits_non_zero(service: TestStack) -> None:
    with grpc.insecure_channel(service.grpc_target) as channel:
        stub = completions_pb2_grpc.CompletionServiceStub(channel)
        call = stub.CreateCompletion(
            grpc_request(prompt="Count:", max_tokens=400, ignore_eos=True, stream=True), timeout=120
        )
        first = next(call)
        assert first.choices

        outcome: dict[str, object] = {}

        def drain() -> None:
            try:
                outcome["messages"] = list(call)
            except grpc.RpcError as error:
                outcome["code"] = error.code()
            outcome["at"] = time.monotonic()

        reader = threading.Thread(target=drain)
        reader.start()
        killed_at = time.monotonic()
        engine_core(service.processes[0].pid).kill()
        reader.join(timeout=ERROR_WITHIN_SECONDS)
        assert not reader.is_alive(), "the stream hung after the engine died"
        assert outcome.get("code") == grpc.StatusCode.UNAVAILABLE, outcome
        assert float(outcome["at"]) - killed_at < ERROR_WITHIN_SECONDS

        health = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + ERROR_WITHIN_SECONDS
        status = None
        while time.monotonic() < deadline:
            try:
                status = health.Check(health_pb2.HealthCheckRequest(), timeout=2).status
            except grpc.RpcError:
                status = None  # already gone
            if status != health_pb2.HealthCheckResponse.SERVING:
                break
            time.sleep(0.2)
        assert status != health_pb2.HealthCheckResponse.SERVING

        with pytest.raises(grpc.RpcError) as raised:
            list(stub.CreateCompletion(grpc_request(model=MODEL, prompt="Hi"), timeout=10))
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE

    assert service.processes[0].wait(timeout=EXIT_WITHIN_SECONDS) == 1
