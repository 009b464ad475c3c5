"""The launcher's discovery of its pools, against a real gRPC server standing in for a
replica: it waits while the replica still loads (UNAVAILABLE), saying so, and takes its first
listing; a key the replica refuses fails at once, naming API_KEY; a pool that never answers
fails at the deadline."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from google.protobuf import struct_pb2
from llmcompletions.v2 import completions_pb2_grpc
from llmcompletions.v2.completions_pb2 import ListModelsRequest, ListModelsResponse, Model

from facade import pools
from facade.pools import Pool, PoolError, discover


class LoadingReplica(completions_pb2_grpc.CompletionServiceServicer):
    """UNAVAILABLE for its first `loading_calls` ListModels calls, then its listing; a call
    without `key` (when set) is UNAUTHENTICATED."""

    def __init__(self, loading_calls: int, key: str | None = None) -> None:
        self.loading_calls = loading_calls
        self.key = key
        self.calls = 0

    def ListModels(
        self, request: ListModelsRequest, context: grpc.ServicerContext
    ) -> ListModelsResponse:
        self.calls += 1
        metadata = dict(context.invocation_metadata())
        if self.key is not None and metadata.get("authorization") != f"Bearer {self.key}":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key")
        if self.calls <= self.loading_calls:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is loading")
        adapter = Model(id="alpha-sql", parent=struct_pb2.Value(string_value="alpha"))
        return ListModelsResponse(object="list", data=[Model(id="alpha"), adapter])


def serving(replica: LoadingReplica) -> Iterator[tuple[str, int]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    completions_pb2_grpc.add_CompletionServiceServicer_to_server(replica, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield ("127.0.0.1", port)
    finally:
        server.stop(grace=None)


@pytest.fixture(autouse=True)
def quick_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pools, "DISCOVERY_POLL_SECONDS", 0.05)
    monkeypatch.setattr(pools, "PROGRESS_EVERY_SECONDS", 0.0)


def test_the_launcher_waits_for_a_loading_pool_and_says_so() -> None:
    replica = LoadingReplica(loading_calls=3, key="k")
    logged: list[str] = []
    for address in serving(replica):
        found, listing = discover([Pool("alpha", (address,))], "k,other", 30, logged.append)
    assert found[0].models == ("alpha", "alpha-sql")
    assert [model.id for model in listing.data] == ["alpha", "alpha-sql"]
    assert replica.calls == 4
    assert any("waiting for pool 'alpha'" in line and "UNAVAILABLE" in line for line in logged)


def test_a_refused_key_fails_at_once_naming_api_key() -> None:
    replica = LoadingReplica(loading_calls=0, key="k")
    for address in serving(replica):
        with pytest.raises(PoolError, match="set API_KEY to the replicas' key"):
            discover([Pool("alpha", (address,))], "wrong", 30, print)
    assert replica.calls == 1


def test_a_pool_that_never_answers_fails_at_the_deadline() -> None:
    replica = LoadingReplica(loading_calls=10**6)
    for address in serving(replica):
        with pytest.raises(PoolError, match="no replica answered ListModels"):
            discover([Pool("alpha", (address,))], None, 0.5, print)
