"""ORCA load reports (xds.data.orca.v3.OrcaLoadReport) on every reply of the serving calls, so
that a picker or proxy in front learns each replica's load from its replies without scraping.

- Always: the binary report in the `endpoint-load-metrics-bin` trailer (gRPC's and Envoy's
  name for it).
- On request, as vLLM's server does: a caller that sends `endpoint-load-metrics-format: text`
  (or `json`) gets the report in the `endpoint-load-metrics` response header too.

What a report says (service.model.load): `named_metrics` num_requests_waiting,
num_requests_running and kv_cache_usage_perc (vLLM's names, as its own header reports them),
and max_num_queued_reqs (the backlog bound: a replica holding that many refuses more), and
`adapter.<name>` (1) for each LoRA adapter in the engine's memory (a picker sends an adapter's
new prompts where it is resident);
`utilization` kv_cache; `application_utilization` the sequences held over the engine's batch
(1: the batch is full; above: requests wait).
"""

from __future__ import annotations

import json
from collections.abc import Callable

from xds.data.orca.v3.orca_load_report_pb2 import OrcaLoadReport

from plumbing.headers import ADAPTER_METRIC_PREFIX
from service.model.load import LoadSnapshot

TRAILER = "endpoint-load-metrics-bin"

HEADER = "endpoint-load-metrics"
FORMAT_HEADER = "endpoint-load-metrics-format"
FORMATS = ("text", "json")

Metadata = tuple[tuple[str, str | bytes], ...]
# The engine's load now, or None before the engine is ready.
LoadSource = Callable[[], LoadSnapshot | None]


def orca_report(load: LoadSnapshot) -> OrcaLoadReport:
    report = OrcaLoadReport(application_utilization=load.utilization)
    report.utilization["kv_cache"] = load.kv_cache_usage
    report.named_metrics["num_requests_waiting"] = load.waiting
    report.named_metrics["num_requests_running"] = load.running
    report.named_metrics["kv_cache_usage_perc"] = load.kv_cache_usage
    report.named_metrics["max_num_queued_reqs"] = load.max_num_queued_reqs
    for adapter in load.adapters:
        report.named_metrics[ADAPTER_METRIC_PREFIX + adapter] = 1
    return report


def text_form(report: OrcaLoadReport) -> str:
    """ORCA's native header form: "TEXT name=value, map.key=value, ..."."""
    parts = [f"application_utilization={report.application_utilization}"]
    parts += [f"utilization.{key}={value}" for key, value in sorted(report.utilization.items())]
    parts += [f"named_metrics.{key}={value}" for key, value in sorted(report.named_metrics.items())]
    return "TEXT " + ", ".join(parts)


def json_form(report: OrcaLoadReport) -> str:
    return "JSON " + json.dumps(
        {
            "application_utilization": report.application_utilization,
            "utilization": dict(report.utilization),
            "named_metrics": dict(report.named_metrics),
        }
    )


def requested_format(invocation_metadata: Metadata) -> str | None:
    for key, value in invocation_metadata:
        if key == FORMAT_HEADER and isinstance(value, str) and value.lower() in FORMATS:
            return value.lower()
    return None


class LoadReports:
    """The report of the moment, in the forms a call gets it."""

    def __init__(self, source: LoadSource) -> None:
        self.source = source

    def trailer(self) -> Metadata:
        load = self.source()
        if load is None:
            return ()
        return ((TRAILER, orca_report(load).SerializeToString()),)

    def header(self, invocation_metadata: Metadata) -> Metadata:
        """The readable form, if the call asked for one."""
        form = requested_format(invocation_metadata)
        load = self.source() if form is not None else None
        if load is None:
            return ()
        report = orca_report(load)
        return ((HEADER, text_form(report) if form == "text" else json_form(report)),)
