"""Envoy's part of a trace: with tracing on, Envoy starts each request's trace (or continues
the caller's W3C `traceparent`), spans the request and each call it makes (to a replica, to the
replica picker), and passes the context on, so that the replica's and the picker's spans join
the same trace. Its spans go to the same OTLP collector as the other processes'."""

from __future__ import annotations

import os
from typing import Any

from facade.addresses import is_ip_address
from facade.envoy_config import connection_manager, grpc_cluster
from facade.tls import TLS_SOCKET, TLS_TYPES
from plumbing.tracing import TracingSettings

COLLECTOR_CLUSTER = "otel_collector"
SYSTEM_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
SAMPLER_ENV = "OTEL_TRACES_SAMPLER"
SAMPLER_ARG_ENV = "OTEL_TRACES_SAMPLER_ARG"
# Envoy sends its spans at least this often (its default, 5 s, makes traces arrive late).
FLUSH_INTERVAL_MS = 1000


def apply_tracing(config: dict[str, Any], settings: TracingSettings) -> None:
    manager = connection_manager(config)
    sampled, sampler = sampling()
    manager["tracing"] = {
        # A span per call to a replica (each retry its own): the replica's span is its child.
        "spawn_upstream_span": True,
        **sampled,
        "provider": {
            "name": "envoy.tracers.opentelemetry",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.config.trace.v3.OpenTelemetryConfig",
                "service_name": settings.service_name,
                **exporter(settings),
                **sampler,
            },
        },
    }
    # With tracing on, Envoy would write its sampling decision into a caller's x-request-id
    # and never sample a request whose id is not a UUID: callers' ids are kept as they are.
    manager["request_id_extension"] = {
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.request_id.uuid.v3.UuidRequestIdConfig",
            "pack_trace_reason": False,
            "use_request_id_for_trace_sampling": False,
        }
    }
    config["static_resources"]["clusters"].append(collector_cluster(settings))
    config["layered_runtime"] = {
        "layers": [
            {
                "name": "tracing",
                "static_layer": {"tracing.opentelemetry.flush_interval_ms": FLUSH_INTERVAL_MS},
            }
        ]
    }


def exporter(settings: TracingSettings) -> dict[str, Any]:
    if settings.protocol == "grpc":
        return {"grpc_service": {"envoy_grpc": {"cluster_name": COLLECTOR_CLUSTER}}}
    host, port, secure = settings.host_and_port
    scheme = "https" if secure else "http"
    return {
        "http_service": {
            "http_uri": {
                "uri": f"{scheme}://{host}:{port}{settings.url_path}",
                "cluster": COLLECTOR_CLUSTER,
                "timeout": "1s",
            }
        }
    }


def sampling() -> tuple[dict[str, Any], dict[str, Any]]:
    """How new traces are sampled, as OTEL_TRACES_SAMPLER (and _ARG) say: the connection
    manager's part and the tracer's. The parent-based samplers (the default among them) keep a
    caller's decision; the others decide alone."""
    sampler = os.environ.get(SAMPLER_ENV, "parentbased_always_on")
    ratio = min(max(float(os.environ.get(SAMPLER_ARG_ENV) or 1.0), 0.0), 1.0)
    if sampler == "always_off":
        return {"random_sampling": {"value": 0}}, {}
    if sampler == "traceidratio":
        return {"random_sampling": {"value": ratio * 100}}, {}
    if sampler in ("parentbased_traceidratio", "parentbased_always_off"):
        share = ratio if sampler == "parentbased_traceidratio" else 0.0
        return {}, {"sampler": parent_based_sampler(share)}
    return {}, {}


def parent_based_sampler(ratio: float) -> dict[str, Any]:
    """The caller's decision if there is one, else a `ratio` share of new traces."""
    extensions = "type.googleapis.com/envoy.extensions.tracers.opentelemetry.samplers.v3"
    return {
        "name": "envoy.tracers.opentelemetry.samplers.parent_based",
        "typed_config": {
            "@type": f"{extensions}.ParentBasedSamplerConfig",
            "wrapped_sampler": {
                "name": "envoy.tracers.opentelemetry.samplers.trace_id_ratio_based",
                "typed_config": {
                    "@type": f"{extensions}.TraceIdRatioBasedSamplerConfig",
                    "sampling_percentage": {
                        "numerator": round(ratio * 1_000_000),
                        "denominator": "MILLION",
                    },
                },
            },
        },
    }


def collector_cluster(settings: TracingSettings) -> dict[str, Any]:
    host, port, secure = settings.host_and_port
    endpoint = {"address": {"socket_address": {"address": host, "port_value": port}}}
    cluster = grpc_cluster(COLLECTOR_CLUSTER, endpoint, by_name=not is_ip_address(host))
    if settings.protocol != "grpc":
        del cluster["typed_extension_protocol_options"]  # OTLP/HTTP: HTTP/1.1 will do
    if secure:
        cluster["transport_socket"] = {
            "name": TLS_SOCKET,
            "typed_config": {
                "@type": f"{TLS_TYPES}UpstreamTlsContext",
                "sni": host,
                "common_tls_context": {
                    "validation_context": {"trusted_ca": {"filename": SYSTEM_CA_BUNDLE}}
                },
            },
        }
    return cluster
