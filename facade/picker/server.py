"""The picker's process: Envoy's external processor (ext_proc), answering each keyed
completion's request headers (with its prompt's path) with the replicas to try, and a loop
following the replicas' health.

Beside one Envoy (facade.launch starts it so), on a Unix socket, following that Envoy's view
from its admin interface:
    python -m facade.picker.server --socket PATH --admin-url URL [--balance-factor N]
Shared by several Envoys (each started with --picker HOST:PORT), on a TCP port, checking the
replicas' health itself; give it the same --upstream or --pool as the Envoys:
    python -m facade.picker.server --listen HOST:PORT --upstream HOST:PORT ... [--balance-factor N]
        [--tls-cert-file F --tls-key-file F [--tls-client-ca-file F]]
(with TLS, each Envoy is started with --picker-ca-file, and --picker-cert-file and
--picker-key-file when the picker requires client certificates).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc

from facade.addresses import parse_address
from facade.balancing import PATH_HEADER
from facade.options import (
    add_balance_factor_option,
    add_listener_tls_options,
    add_replica_address_options,
    add_upstream_tls_options,
    fleet_from,
    upstream_tls_from,
)
from facade.picker import CLUSTER_METADATA, REPLICA_HEADER
from facade.picker.fleet import Clusters, FleetView, read_clusters
from facade.picker.health import CHECK_EVERY_SECONDS, ReplicaChecks
from facade.picker.policy import CacheAwarePolicy, PromptPath
from facade.render import keyed_clusters
from facade.tls import describe_tls, listener_tls
from service.settings import KeepaliveSettings, TlsSettings
from service.transport.call_backlog import call_backlog_options
from service.transport.keepalive import server_options
from service.transport.tls import server_credentials

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
        self.unknown: set[str] = set()  # clusters Envoy asked about that the fleet lacks

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
        if self.fleet.clusters and cluster not in self.fleet.clusters:
            self.warn_unknown(cluster)
        return self.policy.choose(cluster, path, self.fleet.loads(cluster))

    def warn_unknown(self, cluster: str) -> None:
        """Once per cluster: Envoy asks about replicas this picker does not follow (a shared
        picker given other --upstream or --pool than the Envoys); they are hashed instead."""
        if cluster not in self.unknown:
            self.unknown.add(cluster)
            logger.warning(
                "Envoy asked about %s, which this picker does not know (it knows %s); Envoy "
                "hashes its requests instead: give the picker the Envoys' --upstream or --pool",
                cluster,
                ", ".join(sorted(self.fleet.clusters)),
            )


def report(policy: CacheAwarePolicy) -> None:
    """One line on what the picker decided since the last one, if it decided anything."""
    if policy.decisions:
        counts = ", ".join(f"{n} {kind}" for kind, n in sorted(policy.decisions.items()))
        logger.info("picks in the last %d s: %s", REPORT_EVERY_SECONDS, counts)
        policy.decisions.clear()


# A new reading of the replicas' health: from Envoy's admin, or from the picker's own checks;
# None while there is none (the previous view stands).
ReadHealth = Callable[[], Awaitable[Clusters | None]]


def envoy_admin(admin_url: str) -> ReadHealth:
    """Health as the Envoy beside the picker sees it."""

    async def read() -> Clusters | None:
        try:
            return await asyncio.to_thread(read_clusters, admin_url, 1.0)
        except OSError:
            return None  # Envoy starting or stopping

    return read


async def follow(
    read: ReadHealth, every: float, fleet: FleetView, policy: CacheAwarePolicy
) -> None:
    """Keeps the fleet's view current; a replica that stops being healthy is forgotten."""
    next_report = time.monotonic() + REPORT_EVERY_SECONDS
    while True:
        if time.monotonic() >= next_report:
            report(policy)
            next_report += REPORT_EVERY_SECONDS
        try:
            clusters = await read()
        except Exception:  # a view that stopped updating would keep routing to dead replicas
            logger.exception("reading the replicas' health failed; trying again")
            clusters = None
        if clusters is not None:
            for cluster, host in fleet.update(clusters):
                policy.forget_replica(cluster, host)
                logger.info("replica %s of %s is not healthy; its keys go elsewhere", host, cluster)
        await asyncio.sleep(every)


async def serve(
    bind: str,
    read: ReadHealth,
    every: float,
    balance_factor: int,
    tls: TlsSettings | None = None,
) -> None:
    """Answers Envoy on `bind` (unix:PATH or HOST:PORT, over `tls` if given) while following
    the replicas' health."""
    policy = CacheAwarePolicy(balance_factor)
    fleet = FleetView()
    server = grpc.aio.server(
        options=[
            # A second picker on the port fails instead of taking half the Envoys' calls.
            ("grpc.so_reuseport", 0),
            # An Envoy that vanished (a node lost) is noticed, its calls ended and their
            # requests no longer counted as load, within the keepalive's time and timeout.
            *server_options(KeepaliveSettings()),
            # Each keyed request holds a stream for its whole life: a burst of them is not cut.
            *call_backlog_options(),
        ]
    )
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(ReplicaPicker(policy, fleet), server)
    try:
        if tls is None:
            server.add_insecure_port(bind)
        else:
            server.add_secure_port(bind, server_credentials(tls))
    except RuntimeError as error:
        raise SystemExit(f"envoy picker: cannot listen on {bind} (in use?): {error}") from error
    await server.start()
    follower = asyncio.create_task(follow(read, every, fleet, policy))
    try:
        await server.wait_for_termination()
    finally:
        follower.cancel()


async def serve_beside_envoy(args: argparse.Namespace) -> None:
    logger.info("replica picker on %s, following %s", args.socket, args.admin_url)
    await serve(
        f"unix:{args.socket}", envoy_admin(args.admin_url), READ_EVERY_SECONDS, args.balance_factor
    )


async def serve_shared(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    fleet = fleet_from(args, parser)
    try:
        tls = listener_tls(args.tls_cert_file, args.tls_key_file, args.tls_client_ca_file)
    except argparse.ArgumentTypeError as error:
        parser.error(str(error))
    checks = ReplicaChecks(
        keyed_clusters(fleet.upstreams, fleet.pools), upstream_tls_from(args, parser)
    )
    host, port = args.listen
    pools = "; ".join(
        f"{cluster}: {', '.join(f'{name}:{number}' for name, number in addresses)}"
        for cluster, addresses in checks.pools.items()
    )
    logger.info(
        "replica picker on %s:%d (%s) for any Envoy, checking the replicas of %s",
        host,
        port,
        describe_tls(tls),
        pools,
    )
    try:
        await serve(f"{host}:{port}", checks.read, CHECK_EVERY_SECONDS, args.balance_factor, tls)
    finally:
        await checks.close()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m facade.picker.server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--socket", help="beside one Envoy: the Unix socket it calls")
    where.add_argument(
        "--listen",
        type=parse_address,
        help="shared by several Envoys (each started with --picker): the HOST:PORT they call",
    )
    parser.add_argument(
        "--admin-url", help="with --socket: that Envoy's admin, e.g. http://127.0.0.1:9901"
    )
    add_replica_address_options(parser)
    add_upstream_tls_options(parser)
    # Its own variables: a picker sharing the service's environment serves plaintext unless told.
    add_listener_tls_options(parser, "the Envoys' calls (with --listen)", env_prefix="PICKER_")
    add_balance_factor_option(parser)
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="envoy picker: %(message)s")
    if args.socket is not None:
        if args.admin_url is None:
            parser.error("--socket needs --admin-url: the picker follows that Envoy's view")
        asyncio.run(serve_beside_envoy(args))
    else:
        asyncio.run(serve_shared(args, parser))


if __name__ == "__main__":
    main()
