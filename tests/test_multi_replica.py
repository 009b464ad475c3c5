"""Two real service replicas behind one Envoy: both get traffic; a killed replica costs only
its own streams; a draining replica leaves rotation with no failed requests.

Tests run in file order and share the replicas (small engines, so that two fit here).
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

from tests.conftest import ENGINE_START_TIMEOUT, SMALL_ENGINE
from tests.helpers import body
from tests.metrics import sample
from tests.processes import TestStack, free_port

OK = {"method": "CreateCompletion", "code": "OK"}
# Longer than Envoy's health-check interval plus timeout (2 s + 1 s): it stops routing first.
DRAIN_DELAY = 5


@dataclass
class Replica:
    """One service replica, restartable."""

    stack: TestStack
    metrics_port: int

    @classmethod
    def new(cls, log: Path) -> Replica:
        metrics_port = free_port()
        stack = TestStack(
            grpc_port=free_port(),
            service_args=[
                *SMALL_ENGINE,
                "--metrics-port",
                str(metrics_port),
                "--shutdown-grace",
                "30",
                "--drain-delay",
                str(DRAIN_DELAY),
            ],
            service_log=log,
        )
        return cls(stack, metrics_port)

    @property
    def process(self) -> subprocess.Popen[bytes]:
        return self.stack.processes[0]

    @property
    def host(self) -> str:
        return self.stack.grpc_target

    def start(self) -> None:
        self.stack.start(with_envoy=False)

    def wait_ready(self) -> None:
        self.stack.wait_ready_service(ENGINE_START_TIMEOUT)

    def served(self) -> float:
        return sample(
            f"http://127.0.0.1:{self.metrics_port}/metrics", "llmcompletions_requests_total", **OK
        )

    def kill(self) -> None:
        tree = psutil.Process(self.process.pid)
        for process in [*tree.children(recursive=True), tree]:
            process.kill()
        self.process.wait()


@dataclass
class Cluster:
    replicas: list[Replica]
    envoy: subprocess.Popen[bytes]
    base_url: str
    admin_url: str

    def healthy_hosts(self) -> set[str]:
        text = httpx.get(f"{self.admin_url}/clusters", timeout=5).text
        flags = [
            line
            for line in text.splitlines()
            if "completion_service::" in line and "::health_flags::" in line
        ]
        return {line.split("::")[1] for line in flags if line.endswith("::healthy")}

    def wait_healthy(self, count: int, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while len(self.healthy_hosts()) != count:
            assert time.monotonic() < deadline, self.healthy_hosts()
            time.sleep(0.5)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Cluster]:
    logs = tmp_path_factory.mktemp("replicas")
    replicas = [Replica.new(logs / f"replica-{i}.log") for i in range(2)]
    for replica in replicas:
        replica.start()
    http_port, admin_port = free_port(), free_port()
    command = [
        sys.executable,
        "-m",
        "facade.launch",
        "--http-port",
        str(http_port),
        "--admin-port",
        str(admin_port),
        "--debug-headers",  # x-upstream-host names the replica that served each stream
    ]
    for replica in replicas:
        command += ["--upstream", replica.host]
    envoy = subprocess.Popen(command)
    running = Cluster(
        replicas, envoy, f"http://127.0.0.1:{http_port}", f"http://127.0.0.1:{admin_port}"
    )
    try:
        for replica in replicas:
            replica.wait_ready()
        running.wait_healthy(2)
        yield running
    finally:
        envoy.terminate()
        envoy.wait(timeout=30)
        for replica in replicas:
            replica.stack.stop()


async def stream_outcome(
    client: httpx.AsyncClient, max_tokens: int, started: asyncio.Event | None = None
) -> tuple[str, bool]:
    """(upstream host, whether the stream ended with [DONE])"""
    payload = body(prompt="Count:", max_tokens=max_tokens, ignore_eos=True, stream=True)
    host = ""
    try:
        async with client.stream("POST", "/v2/completions", json=payload) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:400]
                return f"status {response.status_code}: {detail}", False
            host = response.headers.get("x-upstream-host", "")
            last = ""
            async for line in response.aiter_lines():
                if line:
                    last = line
                    if started is not None:
                        started.set()
            return host, last == "data: [DONE]"
    except httpx.HTTPError as error:
        return host or type(error).__name__, False


async def burst(
    base_url: str, count: int, max_tokens: int, spacing: float = 0.0
) -> list[tuple[str, bool]]:
    """`count` streams, started `spacing` seconds apart, run to their end."""
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:

        async def delayed(index: int) -> tuple[str, bool]:
            await asyncio.sleep(index * spacing)
            return await stream_outcome(client, max_tokens)

        return await asyncio.gather(*(delayed(index) for index in range(count)))


def test_both_replicas_receive_traffic(cluster: Cluster) -> None:
    before = [replica.served() for replica in cluster.replicas]
    # Least request sends each new stream to the replica with fewer streams in flight.
    outcomes = asyncio.run(burst(cluster.base_url, 8, 48, spacing=0.2))
    assert all(done for _, done in outcomes), outcomes
    after = [replica.served() for replica in cluster.replicas]
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)
    assert len({host for host, _ in outcomes}) == 2


def test_a_killed_replica_costs_only_its_own_streams(cluster: Cluster) -> None:
    victim = cluster.replicas[1]
    victim_host = victim.host

    async def scenario() -> list[tuple[str, bool]]:
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=120) as client:
            events = [asyncio.Event() for _ in range(6)]
            tasks = [asyncio.create_task(stream_outcome(client, 120, event)) for event in events]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), timeout=60)
            victim.kill()
            return await asyncio.gather(*tasks)

    outcomes = asyncio.run(scenario())
    assert {host for host, _ in outcomes} == {
        victim_host,
        cluster.replicas[0].host,
    }
    for host, done in outcomes:
        assert done == (host != victim_host), outcomes
    after = asyncio.run(burst(cluster.base_url, 4, 4))
    assert all(done for _, done in after), after


@pytest.mark.parametrize("index", [0, 1])
def test_a_draining_replica_leaves_rotation_without_failures(cluster: Cluster, index: int) -> None:
    for replica in cluster.replicas:  # bring back the replica killed or drained before
        if replica.process.poll() is not None:
            replica.start()
            replica.wait_ready()
    cluster.wait_healthy(2)
    draining = cluster.replicas[index]
    draining.process.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    left_rotation_after: float | None = None
    outcomes: list[tuple[str, bool]] = []
    # Requests keep coming before, while and after its listener closes (at DRAIN_DELAY).
    while time.monotonic() < signalled + DRAIN_DELAY + 3:
        outcomes += asyncio.run(burst(cluster.base_url, 2, 4))
        if left_rotation_after is None and draining.host not in cluster.healthy_hosts():
            left_rotation_after = time.monotonic() - signalled
    failures = [outcome for outcome in outcomes if not outcome[1]]
    assert outcomes and not failures, failures
    # Envoy took it out while it still served: nothing could reach a closed listener.
    assert left_rotation_after is not None and left_rotation_after < DRAIN_DELAY
    assert draining.process.wait(timeout=60) == 0
    cluster.wait_healthy(1)
