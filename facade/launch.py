"""Start Envoy with envoy.yaml, set to the given ports, limits and upstream gRPC service.

Usage: python -m facade.launch [--http-port PORT] [--admin-port PORT] [--upstream HOST:PORT ...]
       python -m facade.launch [...] --pool NAME=HOST:PORT[,HOST:PORT...] --pool ...
"""

from __future__ import annotations

import argparse
import copy
import ipaddress
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from facade.balancing import (
    BALANCE_POLICIES,
    PrefixAffinity,
    add_prefix_affinity,
    add_replica_picker,
    install_routing_filters,
)
from facade.envoy_config import (
    DESCRIPTOR_FILE,
    FACADE_DIR,
    filter_config,
    grpc_route,
    replica_clusters,
    routes,
)
from facade.picker import start_picker
from facade.pools import Pool, PoolError, discover, listing_header, parse_pool
from facade.tls import (
    UpstreamTls,
    listener_tls,
    listener_transport_socket,
    upstream_tls,
    upstream_transport_socket,
)
from service.options import at_least
from service.settings import ServerSettings, TlsSettings
from service.transport.endpoint_models import ENDPOINT_MODELS_HEADER

ENVOY_TEMPLATE = FACADE_DIR.parent / "envoy.yaml"
LUA_FILE = FACADE_DIR / "completions.lua"
OPENAPI_FILE = FACADE_DIR / "openapi.json"
TEMPLATE = yaml.safe_load(ENVOY_TEMPLATE.read_text())
# The ports of envoy.yaml, the one place they are written.
DEFAULT_HTTP_PORT: int = TEMPLATE["static_resources"]["listeners"][0]["address"]["socket_address"][
    "port_value"
]
DEFAULT_ADMIN_PORT: int = TEMPLATE["admin"]["address"]["socket_address"]["port_value"]
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
# A whole JSON reply: room for the JSON of the largest gRPC message (16 MiB by default).
DEFAULT_MAX_REPLY_BYTES = 64 * 1024 * 1024
MAX_REPLY_HEADER = "x-max-reply-bytes"
# Operators' debugging aid, off by default: which replica served a call, and how long it took.
DEFAULT_DISCOVERY_TIMEOUT = 1800.0  # pools may still be loading large models
ANY_POOL_CLUSTER = "any_pool"
MODEL_HEADER = "x-model"
DEBUG_HEADERS = [
    {"header": {"key": "x-upstream-host", "value": "%UPSTREAM_REMOTE_ADDRESS%"}},
    {"header": {"key": "x-upstream-service-time", "value": "%RESPONSE_DURATION%"}},
    # The call's routing key and its prompt's path (facade/balancing.py), when it has them,
    # and the replicas the replica picker named for it, in order.
    {"header": {"key": "x-prefix-key", "value": "%REQ(x-prefix-key)%"}},
    {"header": {"key": "x-prefix-path", "value": "%REQ(x-prefix-path)%"}},
    {"header": {"key": "x-replica-picked", "value": "%REQ(x-replica)%"}},
]


def is_ip_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def parse_address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def render_config(
    http_port: int,
    admin_port: int,
    upstreams: list[tuple[str, int]],
    listen_host: str = "127.0.0.1",
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES,
    debug_headers: bool = False,
) -> dict[str, Any]:
    """envoy.yaml with ports, upstream endpoints, limits and absolute file paths filled in."""
    config = copy.deepcopy(TEMPLATE)
    config["admin"]["address"]["socket_address"]["port_value"] = admin_port
    listener = config["static_resources"]["listeners"][0]
    listener["address"]["socket_address"].update(address=listen_host, port_value=http_port)
    listener["per_connection_buffer_limit_bytes"] = max_request_bytes
    filter_config(config, "envoy.filters.http.lua")["default_source_code"]["filename"] = str(
        LUA_FILE
    )
    transcoder = filter_config(config, "envoy.filters.http.grpc_json_transcoder")
    transcoder["proto_descriptor"] = str(DESCRIPTOR_FILE)
    transcoder["max_response_body_size"] = max_reply_bytes
    route = grpc_route(config)
    for added in route["request_headers_to_add"]:
        if added["header"]["key"] == MAX_REPLY_HEADER:
            added["header"]["value"] = str(max_reply_bytes)
    if debug_headers:
        route["response_headers_to_add"] = DEBUG_HEADERS
    filter_config(config, "envoy.filters.http.buffer")["max_request_bytes"] = max_request_bytes
    for route in routes(config):
        body = route.get("direct_response", {}).get("body", {})
        if "filename" in body:
            body["filename"] = str(OPENAPI_FILE)
    set_endpoints(config["static_resources"]["clusters"][0], upstreams)
    return config


def set_endpoints(cluster: dict[str, Any], addresses: Sequence[tuple[str, int]]) -> None:
    if any(not is_ip_address(host) for host, _ in addresses):
        cluster["type"] = "STRICT_DNS"  # e.g. a headless Service: every address it resolves to
    cluster["load_assignment"]["endpoints"][0]["lb_endpoints"] = [
        {"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}}
        for host, port in addresses
    ]


def pool_cluster(
    template: dict[str, Any], name: str, addresses: Sequence[tuple[str, int]]
) -> dict[str, Any]:
    """A pool's cluster: the template's balancing, health checks and outlier detection."""
    cluster = copy.deepcopy(template)
    cluster["name"] = cluster["load_assignment"]["cluster_name"] = name
    set_endpoints(cluster, addresses)
    return cluster


def any_pool_cluster(pools: Sequence[Pool]) -> dict[str, Any]:
    """The pools in order, each taking over when those before it have no healthy replica."""
    return {
        "name": ANY_POOL_CLUSTER,
        "connect_timeout": "5s",
        "lb_policy": "CLUSTER_PROVIDED",
        "cluster_type": {
            "name": "envoy.clusters.aggregate",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.clusters.aggregate.v3.ClusterConfig",
                "clusters": [pool.cluster for pool in pools],
            },
        },
    }


def model_route(template: dict[str, Any], model: str, cluster: str) -> dict[str, Any]:
    route = copy.deepcopy(template)
    route["match"]["headers"] = [
        *route["match"]["headers"],
        {"name": MODEL_HEADER, "string_match": {"exact": model}},
    ]
    route["route"]["cluster"] = cluster
    return route


def any_pool_route(template: dict[str, Any], listing: str) -> dict[str, Any]:
    """Calls no pool owns: ListModels and names no pool serves. The replica that answers
    lists (or names in its 404) every pool's models, from the listing passed with the call."""
    route = copy.deepcopy(template)
    route["route"]["cluster"] = ANY_POOL_CLUSTER
    route["request_headers_to_add"] = [
        *route["request_headers_to_add"],
        {
            "header": {"key": ENDPOINT_MODELS_HEADER, "value": listing},
            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
        },
    ]
    return route


def route_by_model(config: dict[str, Any], pools: Sequence[Pool], listing: str) -> None:
    """One cluster per pool, and each call routed to the pool that serves its `model`: Envoy
    reads the field from the request message (REST bodies are transcoded by then)."""
    clusters = config["static_resources"]["clusters"]
    template = clusters[0]
    clusters[:] = [
        *(pool_cluster(template, pool.cluster, pool.addresses) for pool in pools),
        any_pool_cluster(pools),
    ]
    grpc = grpc_route(config)
    by_model = [model_route(grpc, model, pool.cluster) for pool in pools for model in pool.models]
    all_routes = routes(config)
    index = all_routes.index(grpc)
    all_routes[index : index + 1] = [*by_model, any_pool_route(grpc, listing)]


def configure_routing(
    config: dict[str, Any],
    pools: Sequence[Pool],
    listing: str,
    affinity: PrefixAffinity | None,
    picker_socket: Path | None = None,
) -> None:
    """Routes by model over several pools (if given), and prefix affinity within each pool
    (unless least request was asked for), with the replica picker on `picker_socket`."""
    if pools:
        route_by_model(config, pools, listing)
    if affinity is not None:
        add_prefix_affinity(config, affinity)
    install_routing_filters(config, by_model=bool(pools), affinity=affinity)
    if affinity is not None and affinity.picker and picker_socket is not None:
        add_replica_picker(config, str(picker_socket))


def several_replicas(groups: Sequence[Sequence[tuple[str, int]]]) -> bool:
    """Whether any pool has more than one replica (a host name may resolve to several)."""
    return any(len(group) > 1 or not is_ip_address(group[0][0]) for group in groups)


def apply_tls(
    config: dict[str, Any],
    listener: TlsSettings | None,
    upstream: UpstreamTls | None,
    directory: Path,
) -> None:
    """TLS on the listener and on every cluster of replicas (health checks use it too)."""
    if listener is not None:
        chain = config["static_resources"]["listeners"][0]["filter_chains"][0]
        chain["transport_socket"] = listener_transport_socket(listener, directory)
    if upstream is not None:
        for cluster in replica_clusters(config):
            cluster["transport_socket"] = upstream_transport_socket(upstream, directory)


def write_config(config: dict[str, Any], directory: Path) -> Path:
    path = directory / "envoy.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def envoy_command(
    config_path: Path, log_level: str = "warning", concurrency: int | None = None
) -> list[str]:
    envoy = shutil.which("envoy") or str(Path(sys.executable).parent / "envoy")
    # No hot restart: several Envoys (serve and tests) can then share one host.
    command = [envoy, "-c", str(config_path), "--log-level", log_level, "--disable-hot-restart"]
    if concurrency is not None:
        command += ["--concurrency", str(concurrency)]
    return command


def from_env(name: str, fallback: object = None) -> str | None:
    """The variable's text, else the fallback's: argparse converts (and rejects) a text default
    as it does a flag's value, so a bad value gets a usage error rather than a traceback."""
    value = os.environ.get(name) or fallback
    return None if value is None else str(value)


positive_int = at_least(1)
# Envoy's lowest load bound: no replica above the average.
balance_factor = at_least(100)


def log(message: str) -> None:
    print(f"envoy: {message}", flush=True)


def path_option(parser: argparse.ArgumentParser, flag: str, env: str, help_text: str) -> None:
    parser.add_argument(flag, type=Path, default=from_env(env), help=f"{help_text} (env {env})")


def add_tls_options(parser: argparse.ArgumentParser) -> None:
    path_option(
        parser,
        "--tls-cert-file",
        "TLS_CERT_FILE",
        "serve REST and native gRPC over TLS with this PEM certificate (chain); files renamed "
        "into its directory are loaded without a restart; unset: plaintext",
    )
    path_option(parser, "--tls-key-file", "TLS_KEY_FILE", "its PEM private key")
    path_option(
        parser,
        "--tls-client-ca-file",
        "TLS_CLIENT_CA_FILE",
        "require callers' certificates signed by these PEM CA certificates (mutual TLS)",
    )
    path_option(
        parser,
        "--upstream-ca-file",
        "UPSTREAM_CA_FILE",
        "reach the replicas over TLS, trusting the CA certificates in this PEM file; unset: "
        "plaintext",
    )
    path_option(
        parser,
        "--upstream-cert-file",
        "UPSTREAM_CERT_FILE",
        "the PEM client certificate Envoy presents to replicas that require one",
    )
    path_option(parser, "--upstream-key-file", "UPSTREAM_KEY_FILE", "its PEM private key")


def add_balance_options(parser: argparse.ArgumentParser) -> None:
    defaults = PrefixAffinity()
    parser.add_argument(
        "--balance",
        choices=BALANCE_POLICIES,
        default=from_env("BALANCE", "prefix"),
        help="how a pool's replica is picked for a completion: prefix (the replica picker "
        "sends a prompt to the replica that was sent at least half of it before, within a "
        "load bound, and deals mostly new prompts out evenly), prefix-hash (Envoy hashes one "
        "key, the model and the prompt's leading part, with the same bound) or least-request "
        "(env BALANCE; default prefix)",
    )
    parser.add_argument(
        "--prefix-chars",
        type=positive_int,
        default=from_env("PREFIX_CHARS", defaults.chars),
        help="the leading part of a text prompt that keys it for Envoy's hashing (prefix-hash, "
        f"and prefix without its picker), in bytes (env PREFIX_CHARS; default {defaults.chars})",
    )
    parser.add_argument(
        "--prefix-tokens",
        type=positive_int,
        default=from_env("PREFIX_TOKENS", defaults.tokens),
        help="the same for a token-id prompt, in ids (env PREFIX_TOKENS; default "
        f"{defaults.tokens})",
    )
    parser.add_argument(
        "--balance-factor",
        type=balance_factor,
        default=from_env("BALANCE_FACTOR", defaults.balance_factor),
        help="a replica takes a prefix's requests while its requests in flight are within this "
        "percentage of the pool's average, else the next replica does (env BALANCE_FACTOR; "
        f"default {defaults.balance_factor})",
    )


def affinity_from(args: argparse.Namespace) -> PrefixAffinity | None:
    if args.balance == "least-request":
        return None
    picker = args.balance == "prefix"
    return PrefixAffinity(args.prefix_chars, args.prefix_tokens, args.balance_factor, picker)


def describe_tls(tls: TlsSettings | UpstreamTls | None) -> str:
    if tls is None:
        return "plaintext"
    return "mutual TLS" if tls.mutual else "TLS"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--http-port", type=int, default=from_env("HTTP_PORT", DEFAULT_HTTP_PORT))
    parser.add_argument(
        "--admin-port", type=int, default=from_env("ENVOY_ADMIN_PORT", DEFAULT_ADMIN_PORT)
    )
    parser.add_argument(
        "--upstream",
        type=parse_address,
        action="append",
        help="gRPC service HOST:PORT; repeat for several replicas (default 127.0.0.1:$GRPC_PORT)",
    )
    parser.add_argument(
        "--pool",
        type=lambda text: parse_pool(text, parse_address),
        action="append",
        help="NAME=HOST:PORT[,HOST:PORT...]: replicas serving the base model NAME (its served "
        "name) and its adapters; repeat for each base model, and each call goes to the pool "
        "serving its `model` (env POOLS, space-separated)",
    )
    parser.add_argument(
        "--discovery-timeout",
        type=float,
        default=from_env("DISCOVERY_TIMEOUT", DEFAULT_DISCOVERY_TIMEOUT),
        help="with --pool: how long to wait for each pool to answer ListModels (seconds)",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=from_env("MAX_REQUEST_BYTES", DEFAULT_MAX_REQUEST_BYTES),
        help="larger REST request bodies get 413 (env MAX_REQUEST_BYTES)",
    )
    parser.add_argument(
        "--max-reply-bytes",
        type=positive_int,
        default=from_env("MAX_REPLY_BYTES", DEFAULT_MAX_REPLY_BYTES),
        help="largest whole (non-streamed) JSON reply; a larger one is refused with a 400 "
        "that says to stream it (env MAX_REPLY_BYTES)",
    )
    parser.add_argument(
        "--debug-headers",
        action="store_true",
        default=os.environ.get("ENVOY_DEBUG_HEADERS", "") in ("1", "true", "yes", "on"),
        help="add x-upstream-host and x-upstream-service-time to REST and gRPC replies "
        "(env ENVOY_DEBUG_HEADERS=1; off by default: they reveal internal addresses)",
    )
    parser.add_argument(
        "--listen-host",
        default=from_env("LISTEN_HOST", "127.0.0.1"),
        help="address the REST listener binds (0.0.0.0 in a container); admin stays on loopback",
    )
    parser.add_argument(
        "--concurrency",
        type=positive_int,
        default=from_env("ENVOY_CONCURRENCY"),
        help="Envoy worker threads (env ENVOY_CONCURRENCY; default: one per hardware thread)",
    )
    add_tls_options(parser)
    add_balance_options(parser)
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args()
    try:
        pools = args.pool or [
            parse_pool(text, parse_address) for text in os.environ.get("POOLS", "").split()
        ]
        grpc_port = from_env("GRPC_PORT", ServerSettings.port)
        upstreams = args.upstream or [parse_address(f"127.0.0.1:{grpc_port}")]
    except argparse.ArgumentTypeError as error:
        parser.error(f"POOLS or GRPC_PORT: {error}")
    try:
        listener = listener_tls(args.tls_cert_file, args.tls_key_file, args.tls_client_ca_file)
        upstream = upstream_tls(
            args.upstream_ca_file, args.upstream_cert_file, args.upstream_key_file
        )
    except argparse.ArgumentTypeError as error:
        parser.error(str(error))
    if pools and args.upstream:
        parser.error("give either --upstream (one pool) or --pool (several), not both")
    config = render_config(
        args.http_port,
        args.admin_port,
        upstreams,
        listen_host=args.listen_host,
        max_request_bytes=args.max_request_bytes,
        max_reply_bytes=args.max_reply_bytes,
        debug_headers=args.debug_headers,
    )
    listing = ""
    if pools:
        try:
            pools, found = discover(
                pools, os.environ.get("API_KEY"), args.discovery_timeout, log, upstream
            )
            listing = listing_header(found)
        except PoolError as error:
            sys.exit(f"envoy: {error}")
        upstreams = [address for pool in pools for address in pool.addresses]
    affinity = affinity_from(args)
    if affinity is not None and not several_replicas([p.addresses for p in pools] or [upstreams]):
        affinity = None  # one replica per pool: nothing to choose, so no key to compute
    directory = Path(tempfile.mkdtemp(prefix="envoy-facade-"))
    picker_socket = directory / "picker.sock"
    configure_routing(config, pools, listing, affinity, picker_socket)
    apply_tls(config, listener, upstream, directory)
    config_path = write_config(config, directory)
    command = envoy_command(config_path, args.log_level, args.concurrency)
    log(
        f"REST and gRPC on {args.listen_host}:{args.http_port} ({describe_tls(listener)}) -> "
        f"replicas {upstreams} ({describe_tls(upstream)}), balanced by "
        + ("least request" if affinity is None else f"prefix ({affinity})")
    )
    if affinity is not None and affinity.picker:
        start_picker(
            str(picker_socket), f"http://127.0.0.1:{args.admin_port}", affinity.balance_factor
        )
    os.execv(command[0], command)


if __name__ == "__main__":
    main()
