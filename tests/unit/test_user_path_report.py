"""The user-path benchmark's report: each variant of `make serve` against the `vllm serve` run
with the same flags in the same round, serving CPU counting Envoy and the supervisors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench import user_path


def run(throughput: float, **cpu_ms: float) -> dict[str, Any]:
    cpu = {"frontend": 0.0, "engine": 1.0, **cpu_ms}
    cpu["serving"] = sum(cpu.get(role, 0.0) for role in user_path.SERVING_ROLES)
    return {"output_throughput": throughput, "cpu_ms_per_token": cpu}


def measured_round(scale: float) -> dict[str, Any]:
    ours = {
        "rest": run(950 * scale, frontend=0.5, envoy=0.3, supervisor=0.1),
        "grpc": run(1000 * scale, frontend=0.6),
    }
    return {
        "vllm serve": {"rest": run(1000 * scale, frontend=1.0)},
        "vllm serve --stream-interval 4": {"rest": run(2000 * scale, frontend=0.5)},
        "make serve": ours,
        "stream_interval 4": ours,
    }


def test_each_variant_is_compared_with_its_own_peer() -> None:
    assert user_path.peer_key(user_path.VARIANTS["make serve"]) == "vllm serve"
    assert (
        user_path.peer_key(user_path.VARIANTS["stream_interval 4"])
        == "vllm serve --stream-interval 4"
    )
    found = user_path.ratios(measured_round(1.0), "make serve")
    assert found["rest tok/s"] == 0.95 and found["grpc tok/s"] == 1.0
    assert round(found["rest serving CPU"], 6) == 0.9  # frontend + Envoy + supervisors
    assert found["grpc serving CPU"] == 0.6
    against_n4 = user_path.ratios(measured_round(1.0), "stream_interval 4")
    assert against_n4["rest tok/s"] == 0.475 and against_n4["grpc serving CPU"] == 1.2


def test_the_summary_takes_medians_over_rounds_and_the_report_shows_them() -> None:
    rounds = [measured_round(scale) for scale in (0.9, 1.0, 1.2)]
    summary = user_path.summarize(rounds, ["make serve", "stream_interval 4"])
    rest = summary["make serve"]["ratios"]["rest tok/s"]
    assert rest == {"median": 0.95, "min": 0.95, "max": 0.95}  # both sides scale together
    assert summary["make serve"]["cpu_ms_per_token"]["rest"]["output_throughput"] == 950
    target = user_path.Target(Path("model"), user_path.WORKLOAD, "a one-layer random-weight model")
    report = user_path.markdown(summary, rounds=3, target=target)
    assert report.startswith(
        "User path: `make serve` against `vllm serve`, a one-layer random-weight model, "
        "concurrency 64, 256 prompts"
    )
    assert "| make serve | 0.95x (0.95-0.95) |" in report
    assert "| stream_interval 4 | vllm serve | 2000 |" in report
