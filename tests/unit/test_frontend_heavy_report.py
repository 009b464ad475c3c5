"""The frontend-heavy report compares runs measured in the same round, as
docs/benchmarks/where-the-cpu-goes.md quotes it: ours against vLLM's server, and against an
earlier commit of ours when measured."""

from __future__ import annotations

from typing import Any

import pytest

from bench import frontend_heavy
from bench.frontend_heavy import BEFORE, FLOOR, OURS, VLLM


def run(frontend: float, envoy: float = 0.0, messages: float | None = None) -> dict[str, Any]:
    cpu_ms = {"frontend": frontend, "engine": 1.0}
    if envoy:
        cpu_ms["envoy"] = envoy
    return {
        "output_throughput": 1000.0,
        "messages_per_token": messages,
        "cpu_ms_per_token": cpu_ms,
    }


def measured_round(vllm: float, ours: float, before: float | None) -> dict[str, Any]:
    def stack(frontend: float) -> dict[str, Any]:
        return {
            workload.name: {"rest": run(frontend, envoy=0.05), "grpc": run(frontend, messages=1.0)}
            for workload in frontend_heavy.FRONTEND_HEAVY
        }

    found = {
        VLLM: {w.name: {"rest": run(vllm)} for w in frontend_heavy.FRONTEND_HEAVY},
        OURS: stack(ours),
    }
    if before is not None:
        found[BEFORE] = stack(before)
    return found


def test_ratios_are_within_each_round_with_their_median_and_spread() -> None:
    rounds = [measured_round(0.10, 0.08, None), measured_round(0.20, 0.10, None)]
    summary = frontend_heavy.summarize(rounds)
    ratios = summary["fh-c64"]["ratios"]
    assert list(ratios) == ["ours / vLLM"]
    grpc = ratios["ours / vLLM"]["gRPC serving CPU"]
    assert grpc["min"] == pytest.approx(0.5) and grpc["max"] == pytest.approx(0.8)
    assert grpc["median"] == pytest.approx(0.65)
    # Over REST, Envoy's CPU is part of the serving path.
    assert ratios["ours / vLLM"]["REST serving CPU"]["max"] == pytest.approx(1.3)


def test_an_earlier_commit_is_compared_with_vllm_and_with_this_checkout() -> None:
    summary = frontend_heavy.summarize([measured_round(0.10, 0.08, 0.10)] * 3)
    ratios = summary["fh-c256"]["ratios"]
    assert ratios["ours before / vLLM"]["gRPC serving CPU"]["median"] == pytest.approx(1.0)
    assert ratios["ours / ours before"]["gRPC serving CPU"]["median"] == pytest.approx(0.8)
    assert ratios["ours / ours before"]["REST serving CPU"]["median"] == pytest.approx(0.13 / 0.15)
    report = frontend_heavy.markdown(summary, 3, before="abc1234")
    assert "ours at abc1234" in report
    assert "| fh-c64 | ours / ours before | 0.87x (0.87-0.87) | 0.80x (0.80-0.80) |" in report
    assert "| fh-c64 | ours before gRPC | 1000 | 0.100 | 0.000 | 0.100 | 1.000 | 1.00 |" in report
    assert "| fh-c64 | vLLM REST | 1000 | 0.100 | - | 0.100 | 1.000 | - |" in report


def test_each_server_is_shown_above_the_engine_client_alone() -> None:
    rounds = []
    for floor in (0.04, 0.05, 0.06):
        measured = measured_round(0.10, 0.08, None)
        measured[FLOOR] = {w.name: {"none": run(floor)} for w in frontend_heavy.FRONTEND_HEAVY}
        rounds.append(measured)
    summary = frontend_heavy.summarize(rounds)
    found = summary["fh-c64"]["above_floor"]
    assert found["floor"] == pytest.approx(0.05)
    assert found["vLLM"] == pytest.approx(0.05)
    assert found["ours gRPC"] == pytest.approx(0.03)
    assert found["ours REST"] == pytest.approx(0.08)  # Envoy's 0.05 included
    report = frontend_heavy.markdown(summary, 3)
    assert "| fh-c256 | 0.050 | 0.050 | 0.030 | 0.080 |" in report
    assert "| fh-c64 | engine client alone | 1000 | 0.050 | - |" in report
