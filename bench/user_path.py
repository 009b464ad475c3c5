"""Serving cost on the path users run (`make bench-frontend`): `make serve` against `vllm serve`.

Both servers are started as a user comparing them would start them (bench/servers.py:
MakeServe and VllmServe) on the frontend-heavy workload (a one-layer random-weight model, where
the engine is cheap and the serving path's CPU shows). In each round vLLM is measured first
(REST, with vLLM's own benchmark client), then our stack (REST through Envoy with the same
client, then gRPC with a grpc.aio client of the same shape); the order of our variants rotates
between rounds. Every figure of ours is a ratio to vLLM measured in the same round.

CPU is read per process before and after each run: serving = the frontend process plus Envoy
plus the supervisors `make serve` leaves running (make, facade.stack); engine = every process
beneath the frontend (EngineCore and its worker). The load clients run in this process, pinned
to the cores the engines' threads are not bound to, where the machine has any; their own CPU
per token is reported too (this process's CPU time over the run).

Variants: `make serve` as it is, then one change each (--variants): the A/B of the factors on
the path, and `stream_interval` N against `vllm serve --stream-interval N`.

`--model default --workload c8` runs the same comparison on the embedded model with one of
`make bench`'s workloads, where the engine and not the serving path sets the pace.

Usage: python -m bench.user_path [--rounds N] [--variants A;B;...] [--out DIR]
           [--model tiny|default] [--workload NAME]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from bench.frontend_heavy import FRONTEND_HEAVY, spread
from bench.frontend_heavy import ratio_cell as cell
from bench.grpc_client import run_load
from bench.run import MODEL, same_prompts, vllm_bench
from bench.servers import (
    MakeServe,
    OurStack,
    VllmServe,
    cpu_seconds,
    cpu_wait_seconds,
    prioritize_load_clients,
)
from bench.tiny_model import prepare_tiny_model, tiny_settings
from bench.workloads import FULL, Workload
from plumbing.ports import frontend_ports
from plumbing.tracing import ENDPOINT_ENV
from service.model.default_model import prepare_default_model
from service.model.placement import (
    ENGINE_CORE_NAME,
    ENGINE_WORKER_NAME,
    bound_cores,
    confine_engine_core,
    threads,
)
from tests.otlp import OtlpReceiver

# Concurrency 64, 256 prompts, 32 in / 128 out, streaming: where the serving path's cost shows.
WORKLOAD = FRONTEND_HEAVY[0]
# --model default: the embedded model, with `make bench`'s workloads (--workload c1, c8, ...).
WORKLOADS = {workload.name: workload for workload in (*FRONTEND_HEAVY, *FULL)}
WARMUP = Workload("warmup", concurrency=4, num_prompts=8, input_len=16, output_len=8)
SERVING_ROLES = ("frontend", "envoy", "supervisor")


@dataclass(frozen=True)
class Target:
    """The model both servers serve and the workload run against them."""

    model_dir: Path
    workload: Workload
    description: str  # the model, in words


@dataclass(frozen=True)
class Variant:
    """Our stack as `make serve` starts it, with one change; and the vLLM peer it is compared
    with (`vllm serve` plus `vllm_args`)."""

    engine_args: dict[str, Any] = field(default_factory=dict)  # ENGINE_ARGS, merged
    env: dict[str, str] = field(default_factory=dict)
    vllm_args: tuple[str, ...] = ()
    pin_clients: bool = True
    # Our stack as the test harness starts it (flags, its own limits, output to /dev/null)
    # instead of `make serve`: the path docs/benchmarks/where-the-cpu-goes.md measured.
    harness: bool = False
    # make serve's output to /dev/null, as the harness sends it (else to a file per run).
    output_discarded: bool = False
    # Each server in a session of its own, as in a terminal of its own (the default), or both
    # in the benchmark's, with the load clients (one scheduling group: sched_autogroup).
    own_sessions: bool = True
    # Placement, once the server is ready: every thread the engine did not bind moved off the
    # engine's bound cores (ours, and with peer_pinned vLLM's too); the serving processes'
    # threads (frontend, Envoy, supervisors) at this nice value.
    serving_pinned: bool = False
    peer_pinned: bool = False
    serving_nice: int = 0
    # vLLM's engine-core process moved onto the cores its worker is bound to, as our service
    # places its own (service.model.placement.confine_engine_core).
    peer_core_placed: bool = False
    # Ours with its engine-core process let run anywhere again, as vLLM leaves it.
    core_unplaced: bool = False
    # Tracing on (the service's and Envoy's spans, and vLLM's), to a collector in this process.
    tracing: bool = False


def stream_interval(n: int) -> Variant:
    return Variant(engine_args={"stream_interval": n}, vllm_args=("--stream-interval", str(n)))


VARIANTS: dict[str, Variant] = {
    "make serve": Variant(),
    # The factors, one at a time.
    "LOG_LEVEL=WARNING": Variant(env={"LOG_LEVEL": "WARNING"}),
    "clients unpinned": Variant(pin_clients=False),
    "test harness": Variant(harness=True),
    "output to /dev/null": Variant(output_discarded=True),
    "servers in the clients' session": Variant(own_sessions=False),
    "serving pinned": Variant(serving_pinned=True),
    "both serving pinned": Variant(serving_pinned=True, peer_pinned=True),
    "serving niced": Variant(serving_nice=10),
    "ENVOY_CONCURRENCY=1": Variant(env={"ENVOY_CONCURRENCY": "1"}),
    "vllm serve's engine core placed as ours": Variant(peer_core_placed=True),
    "engine core unplaced": Variant(core_unplaced=True),
    "tracing on": Variant(tracing=True),
    # The engine's worker in a process of its own, as vLLM's CPU build runs it (ours runs it
    # inside the engine core: service/model/in_core_worker.py).
    "worker in its own process": Variant(env={"DISTRIBUTED_EXECUTOR_BACKEND": "mp"}),
    # Frontend processes over one engine: ours and vLLM's with the same N.
    "API_SERVER_COUNT=2": Variant(
        env={"API_SERVER_COUNT": "2"}, vllm_args=("--api-server-count", "2")
    ),
    # stream_interval: ours and vLLM's with the same N.
    "stream_interval 4": stream_interval(4),
    "stream_interval 16": stream_interval(16),
}
DEFAULT_VARIANTS = ("make serve",)


def everywhere() -> set[int]:
    """The affinity of a thread that may run on any core."""
    return os.sched_getaffinity(0) | set(range(os.cpu_count() or 1))


def engine_cores(engine_pids: Sequence[int]) -> set[int]:
    """The cores the engines' threads are bound to (none if they may run anywhere)."""
    return bound_cores(threads(engine_pids))


@contextlib.contextmanager
def clients_on(cores: set[int]) -> Iterator[None]:
    """Every thread of this process (where the load clients run) on `cores` for the block;
    threads started inside inherit it."""
    tasks = [int(task.name) for task in Path("/proc/self/task").iterdir()]
    saved = {task: os.sched_getaffinity(task) for task in tasks}
    for task in tasks:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(task, cores)
    try:
        yield
    finally:
        for task, cores_before in saved.items():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(task, cores_before)


def cpu_by_role(roles: dict[str, list[int]]) -> dict[str, float]:
    return {role: sum(cpu_seconds(pid) for pid in pids) for role, pids in roles.items()}


def waits_by_process(roles: dict[str, list[int]]) -> dict[str, float]:
    """Seconds spent waiting for a CPU so far: the engine core, the engine's worker, the
    serving processes (frontend, Envoy, supervisors) together, and the load clients (this
    process)."""
    found = {"engine core": 0.0, "engine worker": 0.0, "serving": 0.0}
    found["load client"] = cpu_wait_seconds(os.getpid())
    for pid in roles.get("engine", []):
        name = process_name(pid)
        if name.startswith(ENGINE_CORE_NAME):
            found["engine core"] += cpu_wait_seconds(pid)
        elif name.startswith(ENGINE_WORKER_NAME):
            found["engine worker"] += cpu_wait_seconds(pid)
    for role in SERVING_ROLES:
        found["serving"] += sum(cpu_wait_seconds(pid) for pid in roles.get(role, []))
    return found


def measured(
    roles: dict[str, list[int]], client_cores: set[int] | None, run: Callable[[], dict]
) -> dict[str, Any]:
    """The run's throughput and latency, CPU milliseconds per output token by role, and the
    milliseconds per second of the run the engine and serving processes waited for a CPU."""
    before = {**cpu_by_role(roles), "client": time.process_time()}
    waits_before, started = waits_by_process(roles), time.monotonic()
    with clients_on(client_cores) if client_cores else contextlib.nullcontext():
        result = run()
    seconds = time.monotonic() - started
    waits_after = waits_by_process(roles)
    after = {**cpu_by_role(roles), "client": time.process_time()}
    tokens = max(result["total_output_tokens"], 1)
    per_token = {role: (after[role] - before[role]) * 1000 / tokens for role in after}
    per_token["serving"] = sum(per_token.get(role, 0.0) for role in SERVING_ROLES)
    return {
        "output_throughput": result["output_throughput"],
        "median_ttft_ms": result["median_ttft_ms"],
        "median_tpot_ms": result["median_tpot_ms"],
        "messages_per_token": result.get("messages_per_token"),
        "client_cores": sorted(client_cores) if client_cores else None,
        "cpu_ms_per_token": per_token,
        "cpu_wait_ms_per_second": {
            name: (waits_after[name] - waits_before[name]) * 1000 / seconds for name in waits_after
        },
    }


def rest_load(base_url: str, endpoint: str, target: Target) -> Callable[[], dict]:
    return lambda: vllm_bench(base_url, endpoint, target.model_dir, target.workload)


def pin_serving(roles: dict[str, list[int]]) -> None:
    """Every thread of the server's processes that may run anywhere, onto the cores the engine's
    bound threads leave free."""
    anywhere = everywhere()
    free = os.sched_getaffinity(0) - engine_cores(roles["engine"])
    if not free:
        return
    for task in threads([pid for pids in roles.values() for pid in pids]):
        with contextlib.suppress(OSError):
            if os.sched_getaffinity(task) == anywhere:
                os.sched_setaffinity(task, free)


def unplace_engine_core(roles: dict[str, list[int]]) -> None:
    core_pids = [pid for pid in roles["engine"] if process_name(pid).startswith(ENGINE_CORE_NAME)]
    for task in threads(core_pids):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(task, everywhere())


def process_name(pid: int) -> str:
    try:
        return psutil.Process(pid).name()
    except psutil.Error:
        return ""


def nice_serving(roles: dict[str, list[int]], nice: int) -> None:
    for task in threads([pid for role in SERVING_ROLES for pid in roles.get(role, [])]):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, task, nice)


def pinned_cores(roles: dict[str, list[int]], pin: bool) -> set[int] | None:
    if not pin:
        return None
    free = os.sched_getaffinity(0) - engine_cores(roles["engine"])
    return free or None


def measure_vllm(target: Target, variant: Variant) -> dict[str, Any]:
    model_dir = target.model_dir
    server = VllmServe(model_dir, MODEL, variant.vllm_args, variant.own_sessions)
    try:
        server.wait_ready()
        vllm_bench(server.base_url, "/v1/completions", model_dir, WARMUP)
        roles = server.processes()
        if variant.peer_pinned:
            pin_serving(roles)
        cores = pinned_cores(roles, variant.pin_clients)
        if variant.peer_core_placed:
            confine_engine_core(server.process.pid)
        return {
            "rest": measured(roles, cores, rest_load(server.base_url, "/v1/completions", target))
        }
    finally:
        server.stop()


@functools.cache
def tracing_env() -> dict[str, str]:
    """Where `make serve` sends its traces: an OTLP receiver in this process, kept until the
    end (it receives every span, as a collector would)."""
    receiver = OtlpReceiver()
    print(f"user path: traces to {receiver.endpoint}", flush=True)
    return {ENDPOINT_ENV: receiver.endpoint}


def measure_ours(target: Target, variant: Variant, log_path: Path) -> dict[str, Any]:
    model_dir, workload = target.model_dir, target.workload
    server: MakeServe | OurStack = (
        OurStack(model_dir, MODEL)
        if variant.harness
        else MakeServe(
            model_dir,
            MODEL,
            variant.engine_args,
            {**variant.env, **tracing_env()} if variant.tracing else variant.env,
            Path(os.devnull) if variant.output_discarded else log_path,
            variant.own_sessions,
        )
    )
    try:
        server.wait_ready()
        vllm_bench(server.base_url, "/v2/completions", model_dir, WARMUP)
        roles = server.processes()
        if variant.serving_pinned:
            pin_serving(roles)
        if variant.serving_nice:
            nice_serving(roles, variant.serving_nice)
        cores = pinned_cores(roles, variant.pin_clients)
        if variant.core_unplaced:
            unplace_engine_core(roles)
        prompts = same_prompts(model_dir, workload)
        # With several frontends, a channel to each (a caller's one channel stays on one).
        targets = frontend_targets(server, variant)
        grpc_load = lambda: asyncio.run(  # noqa: E731
            run_load(targets, MODEL, prompts, workload.output_len, workload.concurrency)
        )
        served = [calls_by_frontend(server.metrics_url)]
        rest = measured(roles, cores, rest_load(server.base_url, "/v2/completions", target))
        served.append(calls_by_frontend(server.metrics_url))
        grpc_run = measured(roles, cores, grpc_load)
        served.append(calls_by_frontend(server.metrics_url))
        rest["frontend_shares"] = shares(served[0], served[1])
        grpc_run["frontend_shares"] = shares(served[1], served[2])
        return {"rest": rest, "grpc": grpc_run}
    finally:
        server.stop()


def frontend_targets(server: MakeServe | OurStack, variant: Variant) -> list[str]:
    count = int(variant.env.get("API_SERVER_COUNT", "1"))
    if count == 1:
        return [server.grpc_target]
    port = int(server.grpc_target.rsplit(":", 1)[1])
    return [f"127.0.0.1:{own}" for own in frontend_ports(port, count)]


def calls_by_frontend(metrics_url: str) -> dict[str, float]:
    """Calls completed so far, by the frontend that served them (the replica's one scrape)."""
    counts: dict[str, float] = {}
    text = httpx.get(metrics_url, timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "llmcompletions_requests_total" and sample.labels["code"] == "OK":
                frontend = sample.labels.get("frontend", "0")
                counts[frontend] = counts.get(frontend, 0.0) + sample.value
    return counts


def shares(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Each frontend's share of the calls completed between two scrapes."""
    grew = {name: after[name] - before.get(name, 0.0) for name in sorted(after)}
    total = sum(grew.values()) or 1.0
    return {name: round(value / total, 3) for name, value in grew.items()}


def peer_key(variant: Variant) -> str:
    """The vLLM run a variant is compared with: one per distinct set of vLLM flags (and
    session)."""
    key = " ".join(["vllm serve", *variant.vllm_args])
    if variant.peer_pinned:
        key += ", serving pinned"
    if variant.peer_core_placed:
        key += ", engine core placed as ours"
    return key if variant.own_sessions else f"{key}, in the clients' session"


def one_round(target: Target, names: Sequence[str], round_index: int, logs: Path) -> dict[str, Any]:
    """vLLM's runs first, then ours; the order of ours rotates by round."""
    found: dict[str, Any] = {}
    for name in names:
        key = peer_key(VARIANTS[name])
        if key not in found:
            print(f"user path: round {round_index + 1}, {key}", flush=True)
            found[key] = measure_vllm(target, VARIANTS[name])
    shift = round_index % len(names)
    for name in [*names[shift:], *names[:shift]]:
        print(f"user path: round {round_index + 1}, ours: {name}", flush=True)
        log_path = logs / f"round{round_index + 1}-{name.replace(' ', '_')}.log"
        found[name] = measure_ours(target, VARIANTS[name], log_path)
    return found


def ratios(measured_round: dict[str, Any], name: str) -> dict[str, float]:
    """Ours (this variant) over its vLLM peer of the same round, by path."""
    peer = measured_round[peer_key(VARIANTS[name])]["rest"]
    found = {}
    for path in ("rest", "grpc"):
        ours = measured_round[name][path]
        found[f"{path} tok/s"] = ours["output_throughput"] / peer["output_throughput"]
        found[f"{path} serving CPU"] = (
            ours["cpu_ms_per_token"]["serving"] / peer["cpu_ms_per_token"]["serving"]
        )
    return found


def summarize(rounds: Sequence[dict[str, Any]], names: Sequence[str]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for name in names:
        per_round = [ratios(measured_round, name) for measured_round in rounds]
        summary[name] = {
            "ratios": {key: spread([r[key] for r in per_round]) for key in per_round[0]},
            "cpu_ms_per_token": {
                path: median_roles([r[name][path] for r in rounds]) for path in ("rest", "grpc")
            },
            "peer_cpu_ms_per_token": median_roles(
                [r[peer_key(VARIANTS[name])]["rest"] for r in rounds]
            ),
            "frontend_shares": {
                path: [r[name][path].get("frontend_shares") for r in rounds]
                for path in ("rest", "grpc")
            },
            "grpc_messages_per_token": [r[name]["grpc"].get("messages_per_token") for r in rounds],
        }
    return summary


def median_roles(runs: Sequence[dict[str, Any]]) -> dict[str, float]:
    roles = runs[0]["cpu_ms_per_token"]
    found = {
        role: statistics.median(run["cpu_ms_per_token"][role] for run in runs) for role in roles
    }
    found["output_throughput"] = statistics.median(run["output_throughput"] for run in runs)
    return found


def markdown(summary: dict[str, Any], rounds: int, target: Target) -> str:
    w = target.workload
    lines = [
        f"User path: `make serve` against `vllm serve`, {target.description}, "
        f"concurrency {w.concurrency}, {w.num_prompts} prompts, {w.input_len} in / "
        f"{w.output_len} out tokens, streaming; {rounds} round(s). Ratios to `vllm serve` "
        "(REST) in the same round, median (min-max). Serving CPU = frontend + Envoy + the "
        "supervisors (make, facade.stack); CPU in ms per output token.",
        "",
        "| variant | REST tok/s | gRPC tok/s | REST serving CPU | gRPC serving CPU |",
        "|---|---|---|---|---|",
    ]
    for name, found in summary.items():
        r = found["ratios"]
        lines.append(
            f"| {name} | {cell(r['rest tok/s'])} | {cell(r['grpc tok/s'])} "
            f"| {cell(r['rest serving CPU'])} | {cell(r['grpc serving CPU'])} |"
        )
    lines += [
        "",
        "Absolute, medians (ms of CPU per output token; engine cores busy = the engine "
        "processes' CPU seconds per second of the run):",
        "",
        "| variant | run | tok/s | frontend | Envoy | supervisors | serving | engine "
        "| engine cores busy | load client |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, found in summary.items():
        rows = {"vllm serve": found["peer_cpu_ms_per_token"], **found["cpu_ms_per_token"]}
        for run, cpu in rows.items():
            lines.append(
                f"| {name} | {run} | {cpu['output_throughput']:.0f} | {cpu['frontend']:.3f} "
                f"| {cpu.get('envoy', 0.0):.3f} | {cpu.get('supervisor', 0.0):.3f} "
                f"| {cpu['serving']:.3f} | {cpu['engine']:.3f} "
                f"| {cpu['engine'] * cpu['output_throughput'] / 1000:.2f} "
                f"| {cpu.get('client', 0.0):.3f} |"
            )
    lines += ["", *shares_table(summary)]
    return "\n".join(lines) + "\n"


def shares_table(summary: dict[str, Any]) -> list[str]:
    """Each frontend's share of the calls, per variant and path (the medians' run)."""
    lines = [
        "Calls served by each frontend (its share of the run's calls, each round), and gRPC "
        "messages per output token (each round):",
        "",
        "| variant | path | shares | gRPC messages per token |",
        "|---|---|---|---|",
    ]
    for name, found in summary.items():
        messages = ", ".join(f"{m:.3f}" for m in found["grpc_messages_per_token"] if m)
        for path, figures in found.get("frontend_shares", {}).items():
            lines.append(f"| {name} | {path} | {figures} | {messages if path == 'grpc' else ''} |")
    return lines


def waits_table(rounds: Sequence[dict[str, Any]]) -> str:
    """Every run of every round: throughput beside how long the engine's and the serving
    processes' threads waited for a CPU (ms per second of the run, summed over threads)."""
    lines = [
        "Every run: output tok/s and milliseconds per second of the run spent waiting for a CPU "
        "(runnable, not running; /proc schedstat summed over each process's threads):",
        "",
        "| round | run | path | tok/s | engine core waited | engine worker waited "
        "| serving processes waited | load client waited |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for index, measured_round in enumerate(rounds, start=1):
        for run, paths in measured_round.items():
            for path, found in paths.items():
                waits = found.get("cpu_wait_ms_per_second")
                if waits is None:
                    continue
                lines.append(
                    f"| {index} | {run} | {path} | {found['output_throughput']:.0f} "
                    f"| {waits['engine core']:.0f} | {waits['engine worker']:.0f} "
                    f"| {waits['serving']:.0f} | {waits.get('load client', 0.0):.0f} |"
                )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--variants",
        default=";".join(DEFAULT_VARIANTS),
        help="';'-separated, of: " + "; ".join(VARIANTS) + " (or 'all')",
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--name", default="user-path", help="the results' file name")
    parser.add_argument(
        "--no-client-priority",
        action="store_true",
        help="leave the load clients' session at the default weight, as users run a client "
        "(else it gets autogroup nice -10: a client starved of CPU measures itself)",
    )
    parser.add_argument(
        "--model",
        choices=("tiny", "default"),
        default="tiny",
        help="a one-layer random-weight model (default), or the embedded model",
    )
    parser.add_argument(
        "--workload",
        choices=list(WORKLOADS),
        default=WORKLOAD.name,
        help=f"default {WORKLOAD.name}; the others are `make bench`'s",
    )
    args = parser.parse_args()
    names = list(VARIANTS) if args.variants == "all" else args.variants.split(";")
    unknown = [name for name in names if name not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    clients = (
        "load clients' session at the default weight (--no-client-priority)"
        if args.no_client_priority
        else prioritize_load_clients()
    )
    print(f"user path: {clients}", flush=True)
    target = (
        Target(prepare_tiny_model(), WORKLOADS[args.workload], "a one-layer random-weight model")
        if args.model == "tiny"
        else Target(prepare_default_model(), WORKLOADS[args.workload], f"the embedded {MODEL}")
    )
    logs = Path(tempfile.mkdtemp(prefix="bench-user-path-"))
    print(f"user path: our stacks' output in {logs}", flush=True)
    rounds, seconds = [], []
    for round_index in range(args.rounds):
        started = time.monotonic()
        rounds.append(one_round(target, names, round_index, logs))
        seconds.append(time.monotonic() - started)
    summary = summarize(rounds, names)
    record = {
        "workload": asdict(target.workload),
        "model": {
            "dir": str(target.model_dir),
            **(tiny_settings() if args.model == "tiny" else {}),
        },
        "variants": {name: asdict(VARIANTS[name]) for name in names},
        "round_seconds": seconds,
        "load_clients": clients,
        "summary": summary,
        "rounds": rounds,
    }
    (args.out / f"{args.name}.json").write_text(json.dumps(record, indent=2))
    report = markdown(summary, args.rounds, target) + f"\nLoad clients: {clients}.\n\n"
    report += waits_table(rounds)
    (args.out / f"{args.name}.md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
