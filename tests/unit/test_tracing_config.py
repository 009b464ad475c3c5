"""Tracing's settings and Envoy's tracer config: off unless an endpoint is given, the standard
variables honoured, and every variant of the rendered config accepted by Envoy itself."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from facade.envoy_config import connection_manager
from facade.render import envoy_command, render_config, write_config
from facade.tracing import COLLECTOR_CLUSTER, apply_tracing
from plumbing.tracing import PROTOCOL_ENV, SERVICE_NAME_ENV, TracingSettings, tracing_settings


def config() -> dict[str, Any]:
    return render_config(8080, 9901, [("127.0.0.1", 50051)])


def test_tracing_is_off_without_an_endpoint() -> None:
    assert tracing_settings(None, "llm-completions") is None
    assert tracing_settings("", "llm-completions") is None
    assert "tracing" not in connection_manager(config())


def test_the_standard_variables_name_the_protocol_and_the_service(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = tracing_settings("http://collector:4317", "llm-completions")
    assert settings == TracingSettings("http://collector:4317", "grpc", "llm-completions")
    monkeypatch.setenv(SERVICE_NAME_ENV, "completions-eu")
    monkeypatch.setenv(PROTOCOL_ENV, "http/protobuf")
    settings = tracing_settings("https://collector.example/v1/traces", "llm-completions")
    assert settings == TracingSettings(
        "https://collector.example/v1/traces", "http/protobuf", "completions-eu"
    )
    assert settings.host_and_port == ("collector.example", 4318, True)
    monkeypatch.setenv(PROTOCOL_ENV, "thrift")
    with pytest.raises(SystemExit, match="grpc, http/protobuf"):
        tracing_settings("http://collector:4317", "llm-completions")


@pytest.mark.parametrize(
    ("endpoint", "protocol", "sampler"),
    [
        ("http://127.0.0.1:4317", "grpc", None),
        ("collector.observability.svc:4317", "grpc", "parentbased_traceidratio"),
        ("http://127.0.0.1:4318/v1/traces", "http/protobuf", "always_off"),
        ("https://collector.example:443/v1/traces", "http/protobuf", "traceidratio"),
    ],
)
def test_envoy_accepts_its_tracer_config(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    endpoint: str,
    protocol: str,
    sampler: str | None,
) -> None:
    if sampler is not None:
        monkeypatch.setenv("OTEL_TRACES_SAMPLER", sampler)
        monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.25")
    rendered = config()
    apply_tracing(rendered, TracingSettings(endpoint, protocol, "llm-completions-envoy"))
    tracing = connection_manager(rendered)["tracing"]
    assert tracing["spawn_upstream_span"] is True
    assert tracing["provider"]["typed_config"]["service_name"] == "llm-completions-envoy"
    clusters = [c["name"] for c in rendered["static_resources"]["clusters"]]
    assert COLLECTOR_CLUSTER in clusters
    command = envoy_command(write_config(rendered, tmp_path))
    checked = subprocess.run(
        [*command, "--mode", "validate"], capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_otlp_exporters_import() -> None:
    """opentelemetry-proto's own files are installed (xds-protos ships an older copy of them,
    which image/install.sh replaces): else every exporter, vLLM's too, fails to import and
    vLLM's tracing stays silently off."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as OTLPHttpSpanExporter,
    )

    assert OTLPSpanExporter and OTLPHttpSpanExporter
