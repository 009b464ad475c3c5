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
from dataclasses import dataclass

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from opentelemetry.trace import SpanKind
from opentelemetry.util.types import AttributeValue

from facade.addresses import FrontendGroups, parse_address, parse_frontend_ports
from facade.balancing import MODEL_HEADER, PATH_HEADER
from facade.options import (
    add_balance_factor_option,
    add_listener_tls_options,
    add_replica_address_options,
    add_upstream_tls_options,
    fleet_from,
    upstream_tls_from,
)
from facade.picker import CLUSTER_METADATA
from facade.picker.fleet import Clusters, FleetView, read_clusters
from facade.picker.health import CHECK_EVERY_SECONDS, ReplicaChecks
from facade.picker.policy import CacheAwarePolicy, PromptPath
from facade.picker.protocol import (
    CANCEL_HEADER,
    CONTINUE_RESPONSE_HEADERS,
    CONTINUE_TRAILERS,
    REQUEST_ID_HEADER,
    HeaderList,
    destination_response,
    header_value,
    load_report,
    no_ready_endpoint,
    served_endpoint,
    shed,
    subset_hint,
    unpicked_response,
)
from facade.render import keyed_clusters
from facade.tls import describe_tls, listener_tls
from plumbing.call_backlog import call_backlog_options
from plumbing.keepalive import KeepaliveSettings, server_options
from plumbing.options import add_option, one_of
from plumbing.tls import TlsSettings, server_credentials
from plumbing.tracing import (
    add_tracing_option,
    incoming_context,
    start_tracing,
    tracer,
    tracing_settings,
)

# The endpoint picker protocol's health services (grpc.health.v1): alive while it answers,
# ready (and its processor too) once it has a view of the replicas; "" as ready.
READY = ("readiness", ext_proc.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name, "")
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
READ_EVERY_SECONDS = 0.25  # health changes at Envoy's 2 s health checks
REPORT_EVERY_SECONDS = 60
logger = logging.getLogger("facade.picker")
# The picker's name in traces, unless OTEL_SERVICE_NAME names it.
DEFAULT_TRACING_NAME = "llm-completions-picker"


@dataclass
class Exchange:
    """What the picker keeps of one request while it runs."""

    cluster: str
    picked: str | None = None  # where the request went, counted as load there until it ends
    request_id: str | None = None
    # With tracing on: the decision's facts, for its span (None: tracing off, nothing kept).
    decision: dict[str, AttributeValue] | None = None

    def note(self, **facts: AttributeValue) -> None:
        if self.decision is not None:
            self.decision.update(facts)


class ReplicaPicker(ext_proc_grpc.ExternalProcessorServicer):
    """One call per keyed request (facade/picker/protocol.py has the protocol): Envoy sends its
    headers, which the picker answers with the replicas to try; then the response's headers
    (with the replica that served it) and trailers (with its load report), which keep the call
    open until the request ends (or is cancelled): the pick counts as load on its replica until
    then."""

    def __init__(self, policy: CacheAwarePolicy, fleet: FleetView, traced: bool = False) -> None:
        self.policy = policy
        self.fleet = fleet
        self.unknown: set[str] = set()  # clusters Envoy asked about that the fleet lacks
        self.traced = traced  # each decision is a span, under Envoy's call to this picker

    async def Process(
        self,
        request_iterator: AsyncIterator[ext_proc.ProcessingRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[ext_proc.ProcessingResponse]:
        cluster = dict(context.invocation_metadata() or ()).get(CLUSTER_METADATA)
        exchange = Exchange(str(cluster or ""), decision={} if self.traced else None)
        try:
            async for request in request_iterator:
                part = request.WhichOneof("request")
                if part == "request_headers" and self.traced:
                    yield self.traced_route(exchange, request, context)
                elif part == "request_headers":
                    yield self.route(exchange, request)
                elif part == "response_headers":
                    self.served(exchange, request)
                    yield CONTINUE_RESPONSE_HEADERS
                else:  # the response's trailers: the only other part Envoy sends
                    self.ended(exchange, request.response_trailers.trailers.headers)
                    yield CONTINUE_TRAILERS
        finally:
            self.release(exchange)

    def traced_route(
        self,
        exchange: Exchange,
        request: ext_proc.ProcessingRequest,
        context: grpc.aio.ServicerContext,
    ) -> ext_proc.ProcessingResponse:
        """`route`, as a span under Envoy's call to this picker (its metadata's traceparent)."""
        parent = incoming_context(context.invocation_metadata())
        with tracer().start_as_current_span(
            "pick replica", context=parent, kind=SpanKind.SERVER
        ) as span:
            response = self.route(exchange, request)
            span.set_attributes({"llm_completions.cluster": exchange.cluster})
            span.set_attributes(exchange.decision or {})
            return response

    def route(
        self, exchange: Exchange, request: ext_proc.ProcessingRequest
    ) -> ext_proc.ProcessingResponse:
        """The answer to a request's headers: where it goes, or why it cannot."""
        headers = request.request_headers.headers.headers
        # A gateway of the Inference Extension's (an InferencePool's endpoint picker) names no
        # cluster: a picker following one pool picks among its replicas.
        exchange.cluster = exchange.cluster or self.fleet.sole_cluster() or ""
        if not exchange.cluster or not self.fleet.synced:
            exchange.note(**{"llm_completions.pick": "none: Envoy balances"})
            return unpicked_response()  # fail open: Envoy balances it itself
        if self.fleet.clusters and exchange.cluster not in self.fleet.clusters:
            self.warn_unknown(exchange.cluster)
            return unpicked_response()
        allowed = subset_hint(request)
        eligible = [
            host
            for host in self.fleet.healthy(exchange.cluster)
            if allowed is None or host in allowed
        ]
        if not eligible:
            exchange.note(**{"llm_completions.pick": "none: no replica ready"})
            return no_ready_endpoint(
                "No replica is ready" + ("" if allowed is None else " among the subset hinted")
            )
        cancelled = header_value(headers, CANCEL_HEADER)
        if cancelled is not None:
            return destination_response(self.cancel_order(cancelled, eligible))
        if self.fleet.saturated(exchange.cluster, eligible):
            exchange.note(**{"llm_completions.pick": "none: every replica at capacity"})
            return shed("Every replica is at capacity; retry shortly.")
        frontends = self.fleet.by_replica(eligible)
        loads = {
            replica: load
            for replica, load in self.fleet.loads(exchange.cluster).items()
            if replica in frontends
        }
        value = header_value(headers, PATH_HEADER)
        path = PromptPath.parse(value) if value else None
        if path is None:  # a gateway without our routing filter: by load alone
            replicas = sorted(loads, key=lambda replica: loads[replica])
        else:
            if exchange.decision is not None:
                exchange.note(**self.prefix_match(exchange.cluster, path, list(loads)))
            model = header_value(headers, MODEL_HEADER)
            holding = self.fleet.holding(exchange.cluster, model) if model else set()
            replicas = self.policy.choose(exchange.cluster, path, loads, holding)
        endpoints = self.endpoints_in_order(exchange.cluster, replicas, frontends)
        exchange.note(
            **{
                "llm_completions.pick": "prefix" if path is not None else "load",
                "llm_completions.replica": endpoints[0],
                "llm_completions.replica_load": loads[replicas[0]],
            }
        )
        self.started(exchange, endpoints[0], header_value(headers, REQUEST_ID_HEADER))
        return destination_response(endpoints)

    def endpoints_in_order(
        self, cluster: str, replicas: list[str], frontends: dict[str, list[str]]
    ) -> list[str]:
        """The replicas' endpoints in the replicas' order; within a replica (one engine, one
        cache), its frontend with the fewest of this picker's requests first."""
        return [
            endpoint
            for replica in replicas
            for endpoint in sorted(
                frontends[replica], key=lambda host: self.fleet.in_flight[(cluster, host)]
            )
        ]

    def prefix_match(
        self, cluster: str, path: PromptPath, replicas: list[str]
    ) -> dict[str, AttributeValue]:
        """How much of the prompt's path a replica was already sent (before this pick)."""
        level, holders = self.policy.deepest_known(cluster, path, dict.fromkeys(replicas, 0))
        return {
            "llm_completions.prefix_known": path.depth(level) if holders else 0,
            "llm_completions.prefix_length": path.covered(),
        }

    def cancel_order(self, request_id: str, eligible: list[str]) -> list[str]:
        """A cancel goes to the replica this picker sent the request to first, then to every
        other (Envoy tries the next while one answers NOT_FOUND)."""
        holder = self.fleet.holders.get(request_id)
        return sorted(eligible, key=lambda host: host != holder)

    def started(self, exchange: Exchange, host: str, request_id: str | None) -> None:
        exchange.picked = host
        self.fleet.started(exchange.cluster, host)
        if request_id is not None:
            exchange.request_id = request_id
            self.fleet.holders[request_id] = host

    def served(self, exchange: Exchange, request: ext_proc.ProcessingRequest) -> None:
        """Envoy names the replica that served the request: after a retry, not the first pick,
        and its load moves there."""
        host = served_endpoint(request)
        if exchange.picked is None or host is None or host == exchange.picked:
            return
        self.fleet.ended(exchange.cluster, exchange.picked)
        self.fleet.started(exchange.cluster, host)
        exchange.picked = host
        if exchange.request_id is not None:
            self.fleet.holders[exchange.request_id] = host

    def ended(self, exchange: Exchange, trailers: HeaderList) -> None:
        report = load_report(trailers)
        if exchange.picked is not None and report is not None:
            self.fleet.reported(exchange.cluster, exchange.picked, report)

    def release(self, exchange: Exchange) -> None:
        if exchange.picked is not None:
            self.fleet.ended(exchange.cluster, exchange.picked)
        if exchange.request_id is not None and self.fleet.holders.get(exchange.request_id) == (
            exchange.picked
        ):
            del self.fleet.holders[exchange.request_id]

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


async def set_health(
    health_servicer: health.aio.HealthServicer, services: tuple[str, ...], status: int
) -> None:
    for service in services:
        await health_servicer.set(service, status)


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
    read: ReadHealth,
    every: float,
    fleet: FleetView,
    policy: CacheAwarePolicy,
    health_servicer: health.aio.HealthServicer,
) -> None:
    """Keeps the fleet's view current; a replica that stops being healthy is forgotten. The
    picker is ready from its first view on."""
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
            first_view = not fleet.synced
            for cluster, host in fleet.update(clusters):
                policy.forget_replica(cluster, host)
                logger.info("replica %s of %s is not healthy; its keys go elsewhere", host, cluster)
            if first_view:
                await set_health(health_servicer, READY, SERVING)
        await asyncio.sleep(every)


async def serve(
    bind: str,
    read: ReadHealth,
    every: float,
    balance_factor: int,
    tls: TlsSettings | None = None,
    count_reports: bool = True,
    traced: bool = False,
    frontends: FrontendGroups | None = None,
) -> None:
    """Answers Envoy on `bind` (unix:PATH or HOST:PORT, over `tls` if given) while following
    the replicas' health; counts their load reports in their load unless told not to; with
    `traced`, each decision is a span. `frontends` says which endpoints are one replica's."""
    policy = CacheAwarePolicy(balance_factor)
    fleet = FleetView(count_reports=count_reports, frontends=frontends or FrontendGroups())
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
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(
        ReplicaPicker(policy, fleet, traced), server
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    try:
        if tls is None:
            server.add_insecure_port(bind)
        else:
            server.add_secure_port(bind, server_credentials(tls))
    except RuntimeError as error:
        raise SystemExit(f"envoy picker: cannot listen on {bind} (in use?): {error}") from error
    await server.start()
    await set_health(health_servicer, ("liveness",), SERVING)
    await set_health(health_servicer, READY, NOT_SERVING)
    follower = asyncio.create_task(follow(read, every, fleet, policy, health_servicer))
    try:
        await server.wait_for_termination()
    finally:
        follower.cancel()


async def serve_beside_envoy(args: argparse.Namespace) -> None:
    logger.info("replica picker on %s, following %s", args.socket, args.admin_url)
    await serve(
        f"unix:{args.socket}",
        envoy_admin(args.admin_url),
        READ_EVERY_SECONDS,
        args.balance_factor,
        count_reports=args.load_reports == "on",
        traced=args.otlp_traces_endpoint is not None,
        frontends=FrontendGroups(tuple(args.frontend_ports or ())),
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
        await serve(
            f"{host}:{port}",
            checks.read,
            CHECK_EVERY_SECONDS,
            args.balance_factor,
            tls,
            count_reports=args.load_reports == "on",
            traced=args.otlp_traces_endpoint is not None,
            frontends=FrontendGroups((*fleet.frontends.port_sets, *(args.frontend_ports or ()))),
        )
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
    parser.add_argument(
        "--frontend-ports",
        type=parse_frontend_ports,
        action="append",
        help="PORT+PORT...: the ports of one replica's frontend processes (on one IP), counted "
        "as one replica; repeat for each such replica (implied by --upstream HOST:PORT+PORT...)",
    )
    add_upstream_tls_options(parser)
    # Its own variables: a picker sharing the service's environment serves plaintext unless told.
    add_listener_tls_options(parser, "the Envoys' calls (with --listen)", env_prefix="PICKER_")
    add_balance_factor_option(parser)
    add_tracing_option(parser)
    add_option(
        parser,
        "--load-reports",
        "PICKER_LOAD_REPORTS",
        "on",
        "on: a replica's load counts the requests its last load report (on its replies) holds "
        "besides this picker's; off: only the requests this picker sent it",
        one_of("on", "off"),
    )
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="envoy picker: %(message)s")
    tracing = tracing_settings(args.otlp_traces_endpoint, DEFAULT_TRACING_NAME)
    if tracing is not None:
        start_tracing(tracing)
    if args.socket is not None:
        if args.admin_url is None:
            parser.error("--socket needs --admin-url: the picker follows that Envoy's view")
        asyncio.run(serve_beside_envoy(args))
    else:
        asyncio.run(serve_shared(args, parser))


if __name__ == "__main__":
    main()
