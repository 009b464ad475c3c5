"""Where each server spends CPU per generated token, and what each serving-path option saves.

Runs one streaming workload against vLLM's OpenAI server and against our stack in each of its
variants (one server at a time, same engine settings), and reports for each run the output
throughput and the CPU milliseconds per output token of the frontend process, the engine-core
process and Envoy. With --py-spy it also samples our frontend with py-spy and lists where its
CPU goes.

"before" runs the code the first benchmark measured (BEFORE_REF, from a git worktree);
"after" today's code with its defaults; the other variants change one option of "after", so
each optimisation's share shows in one run.

--frontend-heavy instead runs bench/frontend_heavy.py's workloads on a tiny random-weight model
(bench/tiny_model.py), where the engine is cheap and the serving path's CPU per token shows:
vLLM's OpenAI server then our stack in each round, interleaved; with --before REF, our stack
at that commit too, so that a change to the serving path is measured before and after.

Usage: python -m bench.profile [--variants before,after,...] [--py-spy] [--out bench/results]
       python -m bench.profile --frontend-heavy [--rounds N] [--before REF] [--out bench/results]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import psutil

from bench import frontend_heavy
from bench.grpc_client import run_load
from bench.run import MODEL, same_prompts, vllm_bench
from bench.servers import REPO, OurStack, VllmOpenAIServer, cpu_seconds
from bench.spy_summary import summarize_stacks
from bench.tiny_model import prepare_tiny_model, tiny_settings
from bench.workloads import Workload
from service.model.default_model import prepare_default_model

WORKLOAD = Workload("c32", concurrency=32, num_prompts=64, input_len=64, output_len=64)
WARMUP = Workload("warmup", concurrency=4, num_prompts=4, input_len=16, output_len=8)

# The commit whose serving path the first `make bench` run measured.
BEFORE_REF = "35f121a"


@dataclass(frozen=True)
class Variant:
    """Our stack from a git ref (None: this checkout), with environment for the service
    and the Envoy launcher (ENVOY_CONCURRENCY)."""

    ref: str | None = None
    env: dict[str, str] | None = None


VARIANTS: dict[str, Variant] = {
    "before": Variant(ref=BEFORE_REF),
    "after": Variant(),
    "after, 1 Envoy worker": Variant(env={"ENVOY_CONCURRENCY": "1"}),
}


@dataclass(frozen=True)
class Roles:
    """The processes of one server, by what they do."""

    frontend: int
    envoy: int | None = None

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time used so far by the frontend, its engine children, and Envoy."""
        frontend = psutil.Process(self.frontend)
        seconds = {
            "frontend": cpu(frontend),
            "engine": sum(cpu(child) for child in frontend.children(recursive=True)),
        }
        if self.envoy is not None:
            seconds["envoy"] = cpu(psutil.Process(self.envoy))
        return seconds


def cpu(process: psutil.Process) -> float:
    return cpu_seconds(process.pid)


def measured(roles: Roles, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run the load; its results plus each role's CPU milliseconds per output token."""
    before = roles.cpu_seconds()
    result = run()
    after = roles.cpu_seconds()
    tokens = max(result["total_output_tokens"], 1)
    per_token = {role: (after[role] - before[role]) * 1000 / tokens for role in after}
    return {
        "output_throughput": result["output_throughput"],
        "median_ttft_ms": result["median_ttft_ms"],
        "median_tpot_ms": result["median_tpot_ms"],
        "messages_per_token": result.get("messages_per_token"),  # counted by our gRPC client
        "cpu_ms_per_token": per_token,
    }


class PySpy:
    """py-spy sampling one process (not its children) until stopped; collapsed stacks."""

    def __init__(self, pid: int, out: Path) -> None:
        self.out = out
        self.process = subprocess.Popen(
            [
                str(Path(sys.executable).parent / "py-spy"),
                "record",
                "--pid",
                str(pid),
                "--rate",
                "200",
                "--nonblocking",
                "--function",
                "--format",
                "raw",
                "--output",
                str(out),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def stop(self) -> Path:
        self.process.send_signal(signal.SIGINT)  # py-spy writes its output on interrupt
        self.process.wait(timeout=60)
        return self.out


def profile_vllm(
    model_dir: Path, workloads: Sequence[Workload] = (WORKLOAD,)
) -> dict[str, dict[str, Any]]:
    """Each workload's REST run against vLLM's OpenAI server, by workload name."""
    server = VllmOpenAIServer(model_dir, MODEL)
    try:
        server.wait_ready()
        vllm_bench(server.base_url, "/v1/completions", model_dir, WARMUP)
        roles = Roles(server.process.pid)
        return {
            workload.name: {
                "rest": measured(
                    roles,
                    partial(vllm_bench, server.base_url, "/v1/completions", model_dir, workload),
                )
            }
            for workload in workloads
        }
    finally:
        server.stop()


@contextmanager
def checkout(ref: str | None) -> Iterator[Path | None]:
    """A temporary worktree of `ref` (None: this checkout, used as it is)."""
    if ref is None:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="bench-") as scratch:
        tree = Path(scratch) / ref
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), ref], check=True)
        try:
            yield tree
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], check=True)


def profile_ours(model_dir: Path, variant: Variant, spy_out: Path | None) -> dict[str, Any]:
    with checkout(variant.ref) as source:
        return profile_stack(OurStack(model_dir, MODEL, variant.env, source), model_dir, spy_out)


def profile_stack(
    stack: OurStack,
    model_dir: Path,
    spy_out: Path | None = None,
    workloads: Sequence[Workload] = (WORKLOAD,),
) -> dict[str, Any]:
    """Each workload's REST and gRPC runs against our stack, by workload name; with spy_out,
    also py-spy's summary of our frontend over all of them, as "py_spy"."""
    try:
        stack.wait_ready()
        vllm_bench(stack.base_url, "/v2/completions", model_dir, WARMUP)
        service, envoy = stack.stack.processes
        roles = Roles(service.pid, envoy.pid)
        spy = PySpy(service.pid, spy_out) if spy_out else None
        runs: dict[str, Any] = {
            workload.name: stack_runs(stack, roles, model_dir, workload) for workload in workloads
        }
        if spy is not None:
            runs["py_spy"] = summarize_stacks(spy.stop())
        return runs
    finally:
        stack.stop()


def stack_runs(
    stack: OurStack, roles: Roles, model_dir: Path, workload: Workload
) -> dict[str, Any]:
    """REST through Envoy, then gRPC directly, with the same prompts."""
    prompts = same_prompts(model_dir, workload)
    return {
        "rest": measured(
            roles, partial(vllm_bench, stack.base_url, "/v2/completions", model_dir, workload)
        ),
        "grpc": measured(
            roles,
            lambda: asyncio.run(
                run_load(
                    stack.grpc_target, MODEL, prompts, workload.output_len, workload.concurrency
                )
            ),
        ),
    }


def one_workload(runs: dict[str, Any]) -> dict[str, Any]:
    """The default mode's record: WORKLOAD's paths, with py-spy's summary beside them."""
    return {**runs.pop(WORKLOAD.name), **runs}


def markdown(results: dict[str, dict[str, Any]]) -> str:
    baseline = results["vllm_openai"]["rest"]
    lines = [
        f"Workload: concurrency {WORKLOAD.concurrency}, {WORKLOAD.num_prompts} prompts, "
        f"{WORKLOAD.input_len} in / {WORKLOAD.output_len} out tokens, streaming.",
        "",
        "| server | path | output tok/s (x vLLM) | frontend CPU ms/token (x vLLM) "
        "| Envoy CPU ms/token | engine CPU ms/token |",
        "|---|---|---|---|---|---|",
    ]
    for server, runs in results.items():
        for path in ("rest", "grpc"):
            if path not in runs:
                continue
            run = runs[path]
            cpu_ms = run["cpu_ms_per_token"]
            throughput = run["output_throughput"]
            lines.append(
                f"| {server} | {path} "
                f"| {throughput:.1f} ({throughput / baseline['output_throughput']:.2f}x) "
                f"| {cpu_ms['frontend']:.2f} "
                f"({cpu_ms['frontend'] / baseline['cpu_ms_per_token']['frontend']:.2f}x) "
                f"| {cpu_ms.get('envoy', 0.0):.2f} | {cpu_ms['engine']:.2f} |"
            )
    for server, runs in results.items():
        if "py_spy" in runs:
            lines += ["", f"### py-spy, our frontend ({server}), share of its samples", ""]
            lines += [f"- {name}: {share:.0%}" for name, share in runs["py_spy"]["groups"]]
            lines += ["", "Top functions (inclusive):", ""]
            lines += [f"- {share:.0%} `{name}`" for name, share in runs["py_spy"]["top"]]
    return "\n".join(lines) + "\n"


# Commits before c0532d2 (2026-12-02) held a frontend's calls beyond MAX_IN_FLIGHT (32 by
# default) in a semaphore, and the benchmarks of then lifted it: so must an A/B against one.
# (Today's service refuses the variable, naming what replaced it.)
UNLIMITED_IN_FLIGHT = {"MAX_IN_FLIGHT": "1024"}
IN_FLIGHT_CAP_REMOVED = "c0532d2"


def capped_in_flight(ref: str) -> bool:
    """Whether `ref` is older than the in-flight cap's removal (c0532d2)."""
    command = ["git", "merge-base", "--is-ancestor", IN_FLIGHT_CAP_REMOVED, ref]
    return subprocess.run(command, cwd=REPO, check=False).returncode != 0


def frontend_heavy_round(model_dir: Path, before: str | None) -> dict[str, Any]:
    """vLLM's OpenAI server, then our stack at `before` (if given), then as this checkout,
    then vLLM's engine client alone, each on every frontend-heavy workload."""
    print("profile: frontend-heavy, vLLM's OpenAI server", flush=True)
    measured_round = {frontend_heavy.VLLM: profile_vllm(model_dir, frontend_heavy.FRONTEND_HEAVY)}
    builds = {frontend_heavy.BEFORE: before} if before else {}
    builds[frontend_heavy.OURS] = None
    for server, ref in builds.items():
        print(f"profile: frontend-heavy, ours at {ref or 'this checkout'}", flush=True)
        with checkout(ref) as source:
            env = UNLIMITED_IN_FLIGHT if ref and capped_in_flight(ref) else None
            stack = OurStack(model_dir, MODEL, source=source, env=env)
            measured_round[server] = profile_stack(
                stack, model_dir, workloads=frontend_heavy.FRONTEND_HEAVY
            )
    print("profile: frontend-heavy, vLLM's engine client alone (no transport)", flush=True)
    measured_round[frontend_heavy.FLOOR] = engine_floor()
    return measured_round


def engine_floor() -> dict[str, Any]:
    """bench/engine_floor.py in a process of its own, so that its CPU is all it measures."""
    with tempfile.TemporaryDirectory(prefix="bench-floor-") as scratch:
        out = Path(scratch) / "floor.json"
        subprocess.run([sys.executable, "-m", "bench.engine_floor", "--out", str(out)], check=True)
        return json.loads(out.read_text())


def run_frontend_heavy(rounds: int, out: Path, before: str | None) -> None:
    model_dir = prepare_tiny_model()
    measured_rounds: list[dict[str, Any]] = []
    round_seconds: list[float] = []
    for round_number in range(1, rounds + 1):
        print(f"profile: frontend-heavy round {round_number} of {rounds}", flush=True)
        started = time.monotonic()
        measured_rounds.append(frontend_heavy_round(model_dir, before))
        round_seconds.append(time.monotonic() - started)
        print(f"profile: round {round_number} took {round_seconds[-1]:.0f} s", flush=True)
    model = {"dir": str(model_dir), **tiny_settings()}
    record = frontend_heavy.record(measured_rounds, model, round_seconds, before)
    report = frontend_heavy.markdown(record["summary"], rounds, before)
    (out / "frontend-heavy.json").write_text(json.dumps(record, indent=2))
    (out / "frontend-heavy.md").write_text(report)
    print(report)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--variants", default=";".join(VARIANTS), help="';'-separated, of: " + "; ".join(VARIANTS)
    )
    parser.add_argument("--py-spy", action="store_true", help="sample our frontend with py-spy")
    parser.add_argument(
        "--frontend-heavy",
        action="store_true",
        help="vLLM against ours on a tiny model, serving CPU per token (variants, py-spy unused)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        help="run the servers this many times, interleaved (default 1; 3 with --frontend-heavy)",
    )
    parser.add_argument(
        "--before",
        metavar="REF",
        help="with --frontend-heavy: also measure our stack at this git commit in every round",
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    options = parser.parse_args()
    options.out.mkdir(parents=True, exist_ok=True)
    if options.frontend_heavy:
        run_frontend_heavy(options.rounds or 3, options.out, options.before)
        return
    rounds = options.rounds or 1
    model_dir = prepare_default_model()
    results = {"vllm_openai": profile_vllm(model_dir)[WORKLOAD.name]}
    for round_number in range(1, rounds + 1):
        for name in options.variants.split(";"):
            label = name if rounds == 1 else f"{name} #{round_number}"
            print(f"profile: ours, {label}", flush=True)
            slug = "-".join(label.replace(",", "").replace("#", "").split())
            spy_out = options.out / f"py-spy-{slug}.txt" if options.py_spy else None
            results[f"ours {label}"] = one_workload(
                profile_ours(model_dir, VARIANTS[name], spy_out)
            )
    record = {
        "workload": asdict(WORKLOAD),
        "variants": {name: asdict(variant) for name, variant in VARIANTS.items()},
        "results": results,
    }
    (options.out / "profile.json").write_text(json.dumps(record, indent=2))
    (options.out / "profile.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
