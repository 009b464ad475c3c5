"""Start Envoy with envoy.yaml, set to the given ports, limits and upstream gRPC service.

Usage: python -m facade.launch [--http-port PORT] [--admin-port PORT] [--upstream HOST:PORT ...]
       python -m facade.launch [...] --pool NAME=HOST:PORT[,HOST:PORT...] --pool ...
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from facade.addresses import Address
from facade.balancing import PrefixAffinity
from facade.options import Fleet, affinity_from, build_parser, fleet_from, upstream_tls_from
from facade.picker import start_picker
from facade.pools import PoolError, discover, listing_header
from facade.render import (
    TEMPLATE,
    apply_tls,
    configure_routing,
    connection_monitor,
    envoy_command,
    render_config,
    several_replicas,
    write_config,
)
from facade.tls import UpstreamTls, describe_tls, listener_tls
from facade.tracing import apply_tracing
from plumbing.open_files import raise_open_files_limit
from plumbing.tls import TlsSettings
from plumbing.tracing import ENDPOINT_ENV, tracing_settings

# Envoy's name in traces, unless OTEL_SERVICE_NAME names it.
DEFAULT_TRACING_NAME = "llm-completions-envoy"


def log(message: str) -> None:
    print(f"envoy: {message}", flush=True)


def tls_from(
    args: argparse.Namespace, parser: argparse.ArgumentParser
) -> tuple[TlsSettings | None, UpstreamTls | None]:
    """TLS on the listener, and to the replicas, each None for plaintext."""
    try:
        listener = listener_tls(args.tls_cert_file, args.tls_key_file, args.tls_client_ca_file)
    except argparse.ArgumentTypeError as error:
        parser.error(str(error))
    return listener, upstream_tls_from(args, parser)


def discovered(fleet: Fleet, upstream: UpstreamTls | None, timeout: float) -> Fleet:
    """With several pools: each pool's models, asked of the pool, and every replica's address."""
    if not fleet.pools:
        return fleet
    try:
        pools, found = discover(fleet.pools, os.environ.get("API_KEY"), timeout, log, upstream)
    except PoolError as error:
        sys.exit(f"envoy: {error}")
    upstreams = [address for pool in pools for address in pool.addresses]
    return Fleet(upstreams, pools, listing_header(found))


def balancing(args: argparse.Namespace, fleet: Fleet) -> PrefixAffinity | None:
    """Prefix affinity as asked, unless no pool has a replica to choose (then no key either)."""
    affinity = affinity_from(args)
    return affinity if several_replicas(fleet.groups) else None


def describe_balance(
    affinity: PrefixAffinity | None, picker: Address | None, picker_tls: UpstreamTls | None
) -> str:
    if affinity is None:
        return "least request"
    if picker is None:
        return f"prefix ({affinity})"
    return (
        f"prefix ({affinity}), asking the shared picker at {picker[0]}:{picker[1]} "
        f"({describe_tls(picker_tls)})"
    )


def warn_if_few_connections(config: dict[str, Any], open_files: int) -> None:
    allowed = connection_monitor(config)["max_active_downstream_connections"]
    if allowed < connection_monitor(TEMPLATE)["max_active_downstream_connections"]:
        log(
            f"at most {allowed} client connections at once (REST calls in flight each hold "
            f"one): the open-files limit is {open_files}; raise it (ulimit -n) for more"
        )


def main() -> None:
    parser = build_parser(__doc__.splitlines()[0])
    args = parser.parse_args()
    if args.picker is not None and args.balance != "prefix":
        parser.error(f"--picker is the picker of --balance prefix, not {args.balance}")
    listener, upstream = tls_from(args, parser)
    picker_tls = upstream_tls_from(args, parser, to="picker")
    if picker_tls is not None and args.picker is None:
        parser.error("--picker-ca-file is how Envoy reaches a shared picker: give --picker too")
    fleet = discovered(fleet_from(args, parser), upstream, args.discovery_timeout)
    config = render_config(
        args.http_port,
        args.admin_port,
        fleet.upstreams,
        listen_host=args.listen_host,
        max_request_bytes=args.max_request_bytes,
        max_reply_bytes=args.max_reply_bytes,
        debug_headers=args.debug_headers,
        open_files=(open_files := raise_open_files_limit()),
    )
    warn_if_few_connections(config, open_files)
    affinity = balancing(args, fleet)
    directory = Path(tempfile.mkdtemp(prefix="envoy-facade-"))
    picker_socket = directory / "picker.sock"
    configure_routing(config, fleet.pools, fleet.listing, affinity, args.picker or picker_socket)
    asks_shared_picker = affinity is not None and affinity.picker and args.picker is not None
    picker = (picker_tls, args.picker) if asks_shared_picker and picker_tls is not None else None
    apply_tls(config, listener, upstream, directory, picker)
    tracing = tracing_settings(args.otlp_traces_endpoint, DEFAULT_TRACING_NAME)
    if tracing is not None:
        apply_tracing(config, tracing)
        os.environ[ENDPOINT_ENV] = tracing.endpoint  # the picker started beside Envoy traces too
    command = envoy_command(write_config(config, directory), args.log_level, args.concurrency)
    log(
        f"REST and gRPC on {args.listen_host}:{args.http_port} ({describe_tls(listener)}) -> "
        f"replicas {fleet.upstreams} ({describe_tls(upstream)}), balanced by "
        + describe_balance(affinity, args.picker, picker_tls)
        + ("" if tracing is None else f"; traces to {tracing.endpoint} as {tracing.service_name}")
    )
    if affinity is not None and affinity.picker and args.picker is None:
        start_picker(
            str(picker_socket),
            f"http://127.0.0.1:{args.admin_port}",
            affinity.balance_factor,
            fleet.frontends.port_sets,
        )
    os.execv(command[0], command)


if __name__ == "__main__":
    main()
