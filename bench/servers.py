"""The servers under test, started with the same engine settings, and their memory."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import psutil

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
    ) -> None:
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
        self.process = subprocess.Popen(
            command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self.pids = [self.process.pid]

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError("vLLM's OpenAI server exited during start")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError("vLLM's OpenAI server did not start")

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
                "--max-in-flight",
                "256",
                "--max-waiting",
                "1024",
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

    def stop(self) -> None:
        self.stack.stop()
