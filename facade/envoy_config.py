"""Where things are in envoy.yaml's structure: the listener's connection manager, its HTTP
filters and routes, the route of gRPC calls."""

from __future__ import annotations

from pathlib import Path
from typing import Any

FACADE_DIR = Path(__file__).resolve().parent
DESCRIPTOR_FILE = FACADE_DIR / "completions.pb"
TRANSCODER = "envoy.filters.http.grpc_json_transcoder"
PICKER_CLUSTER = "replica_picker"  # facade/picker: not a replica


def connection_manager(config: dict[str, Any]) -> dict[str, Any]:
    listener = config["static_resources"]["listeners"][0]
    return listener["filter_chains"][0]["filters"][0]["typed_config"]


def http_filters(config: dict[str, Any]) -> list[dict[str, Any]]:
    return connection_manager(config)["http_filters"]


def routes(config: dict[str, Any]) -> list[dict[str, Any]]:
    return connection_manager(config)["route_config"]["virtual_hosts"][0]["routes"]


def filter_config(config: dict[str, Any], name: str) -> dict[str, Any]:
    return next(f["typed_config"] for f in http_filters(config) if f["name"] == name)


def grpc_route(config: dict[str, Any]) -> dict[str, Any]:
    return next(r for r in routes(config) if "route" in r)


def cluster_named(config: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in config["static_resources"]["clusters"] if c["name"] == name)


def replica_clusters(config: dict[str, Any]) -> list[dict[str, Any]]:
    """The clusters of replicas (not the aggregate of several pools)."""
    return [
        c
        for c in config["static_resources"]["clusters"]
        if "load_assignment" in c and c["name"] != PICKER_CLUSTER
    ]


def http2_options(cluster: dict[str, Any]) -> dict[str, Any]:
    """A cluster's HTTP/2 settings (replicas and the picker speak gRPC)."""
    protocol = cluster["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ]
    return protocol["explicit_http_config"]["http2_protocol_options"]


def grpc_cluster(name: str, endpoint: dict[str, Any], by_name: bool) -> dict[str, Any]:
    """A cluster of one gRPC server (HTTP/2) at `endpoint`; `by_name`: its address is a name,
    resolved by DNS as facade/addresses.py resolves names."""
    cluster: dict[str, Any] = {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3."
                "HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": endpoint}]}],
        },
    }
    if by_name:
        cluster["type"] = "STRICT_DNS"
        cluster["dns_lookup_family"] = "V4_PREFERRED"
    return cluster
