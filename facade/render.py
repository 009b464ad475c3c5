"""Renders Envoy's config for a fleet: envoy.yaml with its ports, limits and file paths
filled in, the replicas of each pool, routing by model and within a pool, TLS."""

from __future__ import annotations

import copy
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from facade.addresses import Address, is_ip_address
from facade.balancing import (
    MODEL_HEADER,
    SERVICE,
    PickerAddress,
    PrefixAffinity,
    add_cancel_routes,
    add_prefix_affinity,
    add_replica_picker,
    install_routing_filters,
    twin_name,
)
from facade.envoy_config import (
    DESCRIPTOR_FILE,
    FACADE_DIR,
    PICKER_CLUSTER,
    cluster_named,
    filter_config,
    grpc_route,
    http_filters,
    replica_clusters,
    routes,
)
from facade.pools import MAX_LISTING_HEADER_BYTES, Pool
from facade.tls import (
    UpstreamTls,
    listener_transport_socket,
    named_server_transport_socket,
    upstream_transport_socket,
)
from plumbing.headers import ENDPOINT_MODELS_HEADER, MAX_REPLY_HEADER
from plumbing.tls import TlsSettings

ENVOY_TEMPLATE = FACADE_DIR.parent / "envoy.yaml"
LUA_FILE = FACADE_DIR / "completions.lua"
OPENAPI_FILE = FACADE_DIR / "openapi.json"
LISTING_LUA_FILE = FACADE_DIR / "endpoint_listing.lua"
LISTING_FILTER = "llmcompletions.endpoint_listing"
LIVE_LISTING_KEY = "live_listing"  # route metadata, under LISTING_FILTER
ROUTER_FILTER = "envoy.filters.http.router"
# How long a call no pool owns waits for each pool's own listing (else the pool's from launch).
LISTING_TIMEOUT_MS = 2000
LIST_MODELS_PATH = f"/{SERVICE.full_name}/ListModels"
TEMPLATE = yaml.safe_load(ENVOY_TEMPLATE.read_text())
# The ports of envoy.yaml, the one place they are written.
DEFAULT_HTTP_PORT: int = TEMPLATE["static_resources"]["listeners"][0]["address"]["socket_address"][
    "port_value"
]
DEFAULT_ADMIN_PORT: int = TEMPLATE["admin"]["address"]["socket_address"]["port_value"]
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
# A whole JSON reply: room for the JSON of the largest gRPC message (16 MiB by default).
DEFAULT_MAX_REPLY_BYTES = 64 * 1024 * 1024
# Open files Envoy keeps for itself (upstream connections, its config and logs), and the fewest
# downstream connections it is given whatever the limit.
OPEN_FILES_RESERVED = 1024
MIN_DOWNSTREAM_CONNECTIONS = 256
ANY_POOL_CLUSTER = "any_pool"
# Operators' debugging aid, off by default: which replica served a call, and how long it took.
DEBUG_HEADERS = [
    {"header": {"key": "x-upstream-host", "value": "%UPSTREAM_REMOTE_ADDRESS%"}},
    {"header": {"key": "x-upstream-service-time", "value": "%RESPONSE_DURATION%"}},
    # The call's routing key and its prompt's path (facade/balancing.py), when it has them,
    # and the replicas the replica picker named for it, in order.
    {"header": {"key": "x-prefix-key", "value": "%REQ(x-prefix-key)%"}},
    {"header": {"key": "x-prefix-path", "value": "%REQ(x-prefix-path)%"}},
    {"header": {"key": "x-replica-picked", "value": "%REQ(x-gateway-destination-endpoint)%"}},
]


def render_config(
    http_port: int,
    admin_port: int,
    upstreams: list[tuple[str, int]],
    listen_host: str = "127.0.0.1",
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES,
    debug_headers: bool = False,
    open_files: int | None = None,
) -> dict[str, Any]:
    """envoy.yaml with ports, upstream endpoints, limits and absolute file paths filled in;
    with `open_files`, at most as many downstream connections as that limit leaves room for."""
    config = copy.deepcopy(TEMPLATE)
    if open_files is not None:
        limit_connections(config, open_files)
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


def connection_monitor(config: dict[str, Any]) -> dict[str, Any]:
    (monitor,) = config["overload_manager"]["resource_monitors"]
    return monitor["typed_config"]


def limit_connections(config: dict[str, Any], open_files: int) -> None:
    """Envoy closes new connections at once rather than failing to accept them for want of
    file descriptors: the limit leaves room for upstream connections and files."""
    room = max(open_files - OPEN_FILES_RESERVED, MIN_DOWNSTREAM_CONNECTIONS)
    monitor = connection_monitor(config)
    monitor["max_active_downstream_connections"] = min(
        monitor["max_active_downstream_connections"], room
    )


def set_endpoints(cluster: dict[str, Any], addresses: Sequence[tuple[str, int]]) -> None:
    if any(not is_ip_address(host) for host, _ in addresses):
        cluster["type"] = "STRICT_DNS"  # e.g. a headless Service: every address it resolves to
        # As a shared replica picker resolves it (facade/addresses.py), so that both name the
        # same replicas.
        cluster["dns_lookup_family"] = "V4_PREFERRED"
    cluster["load_assignment"]["endpoints"][0]["lb_endpoints"] = [
        {"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}}
        for host, port in addresses
    ]


def cluster_addresses(cluster: dict[str, Any]) -> list[Address]:
    """The addresses set_endpoints gave a cluster."""
    endpoints = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    addresses = (endpoint["endpoint"]["address"]["socket_address"] for endpoint in endpoints)
    return [(address["address"], address["port_value"]) for address in addresses]


def pool_cluster(
    template: dict[str, Any], name: str, addresses: Sequence[tuple[str, int]]
) -> dict[str, Any]:
    """A pool's cluster: the template's balancing, health checks and outlier detection."""
    cluster = copy.deepcopy(template)
    cluster["name"] = cluster["load_assignment"]["cluster_name"] = name
    set_endpoints(cluster, addresses)
    return cluster


def any_pool_cluster(pools: Sequence[Pool], template: dict[str, Any]) -> dict[str, Any]:
    """The pools in order, each taking over when those before it have no healthy replica."""
    return {
        "name": ANY_POOL_CLUSTER,
        "connect_timeout": "5s",
        "circuit_breakers": copy.deepcopy(template["circuit_breakers"]),
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
    """The calls for `model` (or, for a pattern ending in `*`, every model it begins) to
    `cluster`."""
    route = copy.deepcopy(template)
    match = {"prefix": model[:-1]} if model.endswith("*") else {"exact": model}
    route["match"]["headers"] = [
        *route["match"]["headers"],
        {"name": MODEL_HEADER, "string_match": match},
    ]
    route["route"]["cluster"] = cluster
    return route


def any_pool_route(template: dict[str, Any], listing: str) -> dict[str, Any]:
    """Calls no pool owns: ListModels and names no pool serves. The replica that answers
    lists (or names in its 404) every pool's models, from the listing passed with the call:
    the one the listing filter asked of the pools, or the one from launch where it has none."""
    route = copy.deepcopy(template)
    route["route"]["cluster"] = ANY_POOL_CLUSTER
    # The listing filter asks the pools for their models on this route's calls only.
    route["metadata"] = {"filter_metadata": {LISTING_FILTER: {LIVE_LISTING_KEY: True}}}
    route["request_headers_to_add"] = [
        *route["request_headers_to_add"],
        {
            "header": {"key": ENDPOINT_MODELS_HEADER, "value": listing},
            "append_action": "ADD_IF_ABSENT",
        },
    ]
    return route


def lua_bytes(data: bytes) -> str:
    """`data` as a Lua string literal (decimal escapes: any byte, in any Lua)."""
    return '"' + "".join(f"\\{byte:03d}" for byte in data) + '"'


def listing_lua(pools: Sequence[Pool]) -> str:
    """endpoint_listing.lua, with the pools it asks and what each listed at launch."""
    entries = "".join(
        f"  {{ cluster = {lua_bytes(pool.cluster.encode())}, "
        f"at_launch = {lua_bytes(pool.listing)} }},\n"
        for pool in pools
    )
    return (
        f"LISTING_POOLS = {{\n{entries}}}\n"
        f"LISTING_HEADER = {lua_bytes(ENDPOINT_MODELS_HEADER.encode())}\n"
        f"LIST_MODELS = {lua_bytes(LIST_MODELS_PATH.encode())}\n"
        f"LIVE_LISTING = {lua_bytes(LIVE_LISTING_KEY.encode())}\n"
        f"MAX_LISTING_HEADER_BYTES = {MAX_LISTING_HEADER_BYTES}\n"
        f"LISTING_TIMEOUT_MS = {LISTING_TIMEOUT_MS}\n"
        f"{LISTING_LUA_FILE.read_text()}"
    )


def add_live_listing(config: dict[str, Any], pools: Sequence[Pool]) -> None:
    """Before the router: the calls no pool owns (ListModels, a name no pool serves) list
    what the pools serve when they are made."""
    filters = http_filters(config)
    router = [f["name"] for f in filters].index(ROUTER_FILTER)
    filters.insert(
        router,
        {
            "name": LISTING_FILTER,
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
                "default_source_code": {"inline_string": listing_lua(pools)},
            },
        },
    )


def route_by_model(config: dict[str, Any], pools: Sequence[Pool], listing: str) -> None:
    """One cluster per pool, and each call routed to the pool that serves its `model`: Envoy
    reads the field from the request message (REST bodies are transcoded by then)."""
    clusters = config["static_resources"]["clusters"]
    template = clusters[0]
    clusters[:] = [
        *(pool_cluster(template, pool.cluster, pool.addresses) for pool in pools),
        any_pool_cluster(pools, template),
    ]
    grpc = grpc_route(config)
    by_model = [model_route(grpc, model, pool.cluster) for pool in pools for model in pool.models]
    # Adapters a pool gains while it serves, by name: after every name served at start.
    by_model += [
        model_route(grpc, pattern, pool.cluster)
        for pool in pools
        for pattern in pool.adapter_patterns
    ]
    all_routes = routes(config)
    index = all_routes.index(grpc)
    all_routes[index : index + 1] = [*by_model, any_pool_route(grpc, listing)]


def configure_routing(
    config: dict[str, Any],
    pools: Sequence[Pool],
    listing: str,
    affinity: PrefixAffinity | None,
    picker: PickerAddress | None = None,
) -> None:
    """Routes by model over several pools (if given), and prefix affinity within each pool
    (unless least request was asked for), with the replica picker at `picker`."""
    if pools:
        route_by_model(config, pools, listing)
        add_live_listing(config, pools)
    if affinity is not None:
        add_prefix_affinity(config, affinity)
    picked = affinity is not None and affinity.picker and picker is not None
    add_cancel_routes(config, picked)
    install_routing_filters(config, by_model=bool(pools), affinity=affinity)
    if picked:
        assert picker is not None
        add_replica_picker(config, picker)


def keyed_clusters(
    upstreams: Sequence[Address], pools: Sequence[Pool]
) -> dict[str, tuple[Address, ...]]:
    """The clusters Envoy asks the replica picker about (each pool's twin balanced by key),
    with the addresses of their replicas."""
    if pools:
        return {twin_name(pool.cluster): pool.addresses for pool in pools}
    return {twin_name(TEMPLATE["static_resources"]["clusters"][0]["name"]): tuple(upstreams)}


def several_replicas(groups: Sequence[Sequence[tuple[str, int]]]) -> bool:
    """Whether any pool has more than one replica (a host name may resolve to several)."""
    return any(len(group) > 1 or not is_ip_address(group[0][0]) for group in groups)


def apply_tls(
    config: dict[str, Any],
    listener: TlsSettings | None,
    upstream: UpstreamTls | None,
    directory: Path,
    picker: tuple[UpstreamTls, Address] | None = None,
) -> None:
    """TLS on the listener, on every cluster of replicas (health checks use it too) and to
    the shared picker at its address, if given. After configure_routing: each cluster's
    replicas are its own by then (a pool's, not the template's)."""
    if listener is not None:
        chain = config["static_resources"]["listeners"][0]["filter_chains"][0]
        chain["transport_socket"] = listener_transport_socket(listener, directory)
    if upstream is not None:
        for cluster in replica_clusters(config):
            hosts = [host for host, _ in cluster_addresses(cluster)]
            cluster["transport_socket"] = upstream_transport_socket(upstream, directory, hosts)
    if picker is not None:
        tls, (host, _) = picker
        cluster_named(config, PICKER_CLUSTER)["transport_socket"] = named_server_transport_socket(
            tls, directory, "picker", host
        )


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
