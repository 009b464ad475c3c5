"""The picker's process: Envoy's external processor (ext_proc) on a Unix socket, answering each
keyed completion's request headers (with its prompt's path) with the replicas to try, and a loop
reading Envoy's view of the replicas from its admin interface.

Usage: python -m facade.picker.server --socket PATH --admin-url URL [--balance-factor N]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc

from facade.balancing import PATH_HEADER
from facade.picker import CLUSTER_METADATA, REPLICA_HEADER
from facade.picker.fleet import FleetView, read_clusters
from facade.picker.policy import CacheAwarePolicy, PromptPath

READ_EVERY_SECONDS = 0.25  # health changes at Envoy's 2 s health checks
REPORT_EVERY_SECONDS = 60
logger = logging.getLogger("facade.picker")


def header_value(headers: ext_proc.HttpHeaders, name: str) -> str | None:
    for header in headers.headers.headers:
        if header.key == name:
            return header.raw_value.decode() if header.raw_value else header.value
    return None


def replica_response(replicas: list[str]) -> ext_proc.ProcessingResponse:
    """The request goes on, with the replicas to try in REPLICA_HEADER (if any)."""
    response = ext_proc.ProcessingResponse(request_headers=ext_proc.HeadersResponse())
    if replicas:
        response.request_headers.response.header_mutation.set_headers.append(
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(
                    key=REPLICA_HEADER, raw_value=",".join(replicas).encode()
                ),
                append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
            )
        )
    return response


CONTINUE_TRAILERS = ext_proc.ProcessingResponse(response_trailers=ext_proc.TrailersResponse())


class ReplicaPicker(ext_proc_grpc.ExternalProcessorServicer):
    """One call per keyed request: Envoy sends its headers, which the picker answers with the
    replicas to try, and later the response's trailers, which keep the call open until the
    request ends (or it is cancelled): the pick counts as load on its replica until then."""

    def __init__(self, policy: CacheAwarePolicy, fleet: FleetView) -> None:
        self.policy = policy
        self.fleet = fleet

    async def Process(
        self,
        request_iterator: AsyncIterator[ext_proc.ProcessingRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[ext_proc.ProcessingResponse]:
        cluster = dict(context.invocation_metadata() or ()).get(CLUSTER_METADATA)
        picked: str | None = None
        try:
            async for request in request_iterator:
                if request.WhichOneof("request") == "request_headers":
                    value = header_value(request.request_headers, PATH_HEADER)
                    path = PromptPath.parse(value) if value else None
                    replicas = self.pick(str(cluster), path) if cluster and path else []
                    if replicas:
                        picked = replicas[0]
                        self.fleet.started(str(cluster), picked)
                    yield replica_response(replicas)
                else:  # the response's trailers: the only other part Envoy sends
                    yield CONTINUE_TRAILERS
        finally:
            if picked is not None:
                self.fleet.ended(str(cluster), picked)

    def pick(self, cluster: str, path: PromptPath) -> list[str]:
        return self.policy.choose(cluster, path, self.fleet.loads(cluster))


def report(policy: CacheAwarePolicy) -> None:
    """One line on what the picker decided since the last one, if it decided anything."""
    if policy.decisions:
        counts = ", ".join(f"{n} {kind}" for kind, n in sorted(policy.decisions.items()))
        logger.info("picks in the last %d s: %s", REPORT_EVERY_SECONDS, counts)
        policy.decisions.clear()


async def follow_envoy(admin_url: str, fleet: FleetView, policy: CacheAwarePolicy) -> None:
    """Keeps the fleet's view current; a replica that stops being healthy is forgotten."""
    next_report = time.monotonic() + REPORT_EVERY_SECONDS
    while True:
        if time.monotonic() >= next_report:
            report(policy)
            next_report += REPORT_EVERY_SECONDS
        try:
            clusters = await asyncio.to_thread(read_clusters, admin_url, 1.0)
        except OSError:
            pass  # Envoy starting or stopping; the previous view stands
        else:
            for cluster, host in fleet.update(clusters):
                policy.forget_replica(cluster, host)
                logger.info("replica %s of %s is not healthy; its keys go elsewhere", host, cluster)
        await asyncio.sleep(READ_EVERY_SECONDS)


async def serve(socket_path: str, admin_url: str, balance_factor: int) -> None:
    policy = CacheAwarePolicy(balance_factor)
    fleet = FleetView()
    server = grpc.aio.server()
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(ReplicaPicker(policy, fleet), server)
    server.add_insecure_port(f"unix:{socket_path}")
    await server.start()
    logger.info("replica picker on %s, following %s", socket_path, admin_url)
    follower = asyncio.create_task(follow_envoy(admin_url, fleet, policy))
    try:
        await server.wait_for_termination()
    finally:
        follower.cancel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--socket", required=True, help="the Unix socket Envoy calls")
    parser.add_argument(
        "--admin-url", required=True, help="Envoy's admin, e.g. http://127.0.0.1:9901"
    )
    parser.add_argument("--balance-factor", type=int, default=125)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="envoy picker: %(message)s")
    asyncio.run(serve(args.socket, args.admin_url, args.balance_factor))


if __name__ == "__main__":
    main()
