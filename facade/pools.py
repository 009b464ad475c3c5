"""Pools of replicas behind one Envoy, one pool per base model: what each pool serves (learned
from its ListModels at start) and the endpoint's listing of every pool's models."""

from __future__ import annotations

import argparse
import base64
import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
from llmcompletions.v2 import completions_pb2_grpc
from llmcompletions.v2.completions_pb2 import ListModelsRequest, ListModelsResponse

from facade.addresses import frontend_port_sets, parse_replica
from facade.tls import UpstreamTls, grpc_channel

# Envoy passes the endpoint's listing in plumbing.headers.ENDPOINT_MODELS_HEADER, base64.
# A gRPC server refuses request metadata past 8 KiB by default; the listing stays well inside.
MAX_LISTING_HEADER_BYTES = 6 * 1024
DISCOVERY_POLL_SECONDS = 2.0
PROGRESS_EVERY_SECONDS = 15.0


class PoolError(RuntimeError):
    """Pools that cannot be served behind one endpoint; the message says which and why."""


@dataclass(frozen=True)
class Pool:
    """Replicas serving one base model (its served name) and that model's adapters."""

    name: str
    addresses: tuple[tuple[str, int], ...]  # every frontend of every replica
    models: tuple[str, ...] = ()  # every served name, learned from the pool
    # Names of adapters the pool may gain while it serves: exact, or a prefix ending in `*`.
    adapter_patterns: tuple[str, ...] = ()
    frontend_ports: tuple[tuple[int, ...], ...] = ()  # replicas with several frontends
    listing: bytes = b""  # its ListModelsResponse at launch, serialized

    @property
    def cluster(self) -> str:
        return f"pool_{self.name}"


def parse_pool(text: str) -> Pool:
    """NAME=REPLICA[,REPLICA...], each HOST:PORT or HOST:PORT+PORT... (several frontends)"""
    name, separator, addresses = text.partition("=")
    if not separator or not name or not addresses:
        raise argparse.ArgumentTypeError(f"expected NAME=HOST:PORT[,HOST:PORT...], got {text!r}")
    replicas = [parse_replica(replica) for replica in addresses.split(",")]
    return Pool(
        name,
        tuple(address for replica in replicas for address in replica),
        frontend_ports=frontend_port_sets(replicas),
    )


def parse_pool_adapters(text: str) -> tuple[str, tuple[str, ...]]:
    """NAME=PATTERN[,PATTERN...]: a pool's adapter names, each exact or a prefix then `*`."""
    name, separator, given = text.partition("=")
    patterns = tuple(pattern for pattern in given.split(",") if pattern)
    if not separator or not name or not patterns:
        raise argparse.ArgumentTypeError(f"expected NAME=PATTERN[,PATTERN...], got {text!r}")
    for pattern in patterns:
        if "*" in pattern[:-1] or pattern == "*":
            raise argparse.ArgumentTypeError(
                f"{pattern!r}: a pattern is a name, or a prefix followed by one `*` at its end"
            )
    return name, patterns


def with_adapter_patterns(
    pools: Sequence[Pool], given: Sequence[tuple[str, tuple[str, ...]]]
) -> list[Pool]:
    """The pools, each with the adapter patterns given for it."""
    names = {pool.name for pool in pools}
    for name, _ in given:
        if name not in names:
            raise PoolError(f"--pool-adapters names pool {name!r}, which no --pool gives")
    patterns = {name: found for name, found in given}
    return [
        dataclasses.replace(pool, adapter_patterns=patterns.get(pool.name, ())) for pool in pools
    ]


def list_models(
    address: tuple[str, int], api_key: str | None, timeout: float, tls: UpstreamTls | None
) -> ListModelsResponse:
    host, port = address
    # One of the replicas' keys (API_KEY may hold several, comma-separated).
    metadata = [("authorization", f"Bearer {api_key.split(',')[0].strip()}")] if api_key else []
    with grpc_channel(f"{host}:{port}", tls) as channel:
        stub = completions_pb2_grpc.CompletionServiceStub(channel)
        return stub.ListModels(ListModelsRequest(), timeout=timeout, metadata=metadata)


def pool_listing(
    pool: Pool,
    api_key: str | None,
    deadline: float,
    log: Callable[[str], None],
    tls: UpstreamTls | None,
) -> ListModelsResponse:
    """The first answer of any of the pool's replicas, waiting while they load."""
    last_report = time.monotonic()
    while True:
        for address in pool.addresses:
            try:
                return list_models(address, api_key, timeout=5.0, tls=tls)
            except grpc.RpcError as error:
                problem = f"{address[0]}:{address[1]} {error.code().name}"
                if error.code() == grpc.StatusCode.UNAUTHENTICATED:
                    raise PoolError(
                        f"pool {pool.name!r}: {problem}; set API_KEY to the replicas' key"
                    ) from error
        now = time.monotonic()
        if now > deadline:
            raise PoolError(f"pool {pool.name!r}: no replica answered ListModels ({problem})")
        if now - last_report >= PROGRESS_EVERY_SECONDS:
            log(f"waiting for pool {pool.name!r}: {problem} (a replica may still be loading)")
            last_report = now
        time.sleep(DISCOVERY_POLL_SECONDS)


def checked(pool: Pool, listing: ListModelsResponse) -> Pool:
    """The pool with its served names, if its base model is the one it is named after."""
    bases = [
        model.id for model in listing.data if model.parent.WhichOneof("kind") != "string_value"
    ]
    if bases != [pool.name]:
        raise PoolError(
            f"pool {pool.name!r} serves base model(s) {bases}: name each pool after the "
            "served name of its base model (--served-model-name)"
        )
    return dataclasses.replace(
        pool,
        models=tuple(model.id for model in listing.data),
        listing=listing.SerializeToString(),
    )


def discover(
    pools: Sequence[Pool],
    api_key: str | None,
    timeout: float,
    log: Callable[[str], None],
    tls: UpstreamTls | None = None,
) -> tuple[list[Pool], ListModelsResponse]:
    """Each pool with its served names, and the endpoint's listing of them all."""
    deadline = time.monotonic() + timeout
    found: list[Pool] = []
    endpoint = ListModelsResponse(object="list")
    owners: dict[str, str] = {}
    for pool in pools:
        listing = pool_listing(pool, api_key, deadline, log, tls)
        pool = checked(pool, listing)
        for name in pool.models:
            if name in owners:
                raise PoolError(
                    f"model {name!r} is served by pools {owners[name]!r} and {pool.name!r}"
                )
            owners[name] = pool.name
        endpoint.data.extend(listing.data)
        found.append(pool)
        log(f"pool {pool.name!r}: {', '.join(pool.models)}")
    return found, endpoint


def listing_header(listing: ListModelsResponse) -> str:
    """The endpoint's listing as the value of ENDPOINT_MODELS_HEADER."""
    value = base64.b64encode(listing.SerializeToString()).decode("ascii")
    if len(value) > MAX_LISTING_HEADER_BYTES:
        raise PoolError(
            f"the endpoint serves {len(listing.data)} models, too many to list in one header "
            f"({len(value)} > {MAX_LISTING_HEADER_BYTES} bytes): split them over several facades"
        )
    return value
