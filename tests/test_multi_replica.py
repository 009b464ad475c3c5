"""Two real service replicas behind one real Envoy, under sustained REST and gRPC traffic
through Envoy the whole time:

1. Envoy starts while the replicas are still loading: each replica joins rotation within
   seconds of reporting SERVING, no request reaches a replica before, and none is ejected.
2. One replica drains under traffic, with a long stream in flight, a silent HTTP/2 connection
   and a health Watch stream open to it: no client fails, the drain lasts the delay plus the
   rest of the longest request in flight, and the process is gone right after `stopped`.
3. It restarts on the same ports and rejoins rotation within seconds of SERVING.
4. The other replica's server is SIGKILLed, as the OOM killer does: its engine's processes
   die with it and its port is free at once; only the requests in flight on it fail, and
   every request sent a few seconds later succeeds.

Tests run in file order and share the replicas and the traffic (small engines, so that two fit
on this machine). Each prints what it measured; docs/scaling-out/fleet.md ("Measured") reports
these figures.
"""

from __future__ import annotations

import json
import logging
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import grpc
import httpx
import psutil
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from llmcompletions.v2 import completions_pb2_grpc

from facade.render import ENVOY_TEMPLATE
from service.settings import ServerSettings
from tests.conftest import ENGINE_START_TIMEOUT, SMALL_ENGINE
from tests.helpers import body, grpc_request
from tests.metrics import sample
from tests.processes import (
    TestStack,
    free_port,
    is_engine,
    left_running,
    stop_helpers,
    thread_affinities,
)

logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise

DRAIN_DELAY = 5.0
GRACE = 60.0  # far longer than any drain here: a drain must not need it
EXIT_AFTER_STOPPED_SECONDS = 30.0
# The engine's processes go with the server: the kernel kills them, and they count as gone once
# their exit has begun (the kernel then took up to 15 s and more to tear down a worker of several
# GiB, in disk-sleep, on a host busy with the other shard). multiprocessing's resource tracker
# leaves by itself after that teardown: its bound is a hang guard.
ENGINE_GONE_SECONDS = 15.0
TRACKER_GONE_SECONDS = 60.0
TOKENS = 24  # per request of the sustained traffic
# The stream in flight across a drain: past the delay even on a replica with a core of its own.
LONG_TOKENS = 240
KILL_SETTLE = 3.0  # "a few seconds later"
POLL = 0.2
SERVING = health_pb2.HealthCheckResponse.SERVING
# Envoy's clusters of the replicas: least request, and its twin balanced by prefix.
REPLICA_CLUSTERS = ("completion_service", "completion_service_prefix")


def health_check_pace() -> float:
    """The longest a SERVING replica waits for Envoy's next passing check: interval + timeout."""
    (check,) = yaml.safe_load(ENVOY_TEMPLATE.read_text())["static_resources"]["clusters"][0][
        "health_checks"
    ]
    return sum(float(check[key].removesuffix("s")) for key in ("interval", "timeout"))


# Joining rotation: the next health check (plus our own polling's granularity).
JOIN_WITHIN = health_check_pace() + 1.0


def stable_port() -> int:
    """A free port below the kernel's ephemeral range. `free_port` picks one inside it, where
    any outgoing connection on this busy host can take it as its local port before a replica
    listens on it, or between a replica's exit and its restart (seen: the metrics port then
    fails with "Address already in use")."""
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(100):
        port = random.randrange(max(1024, ephemeral_low - 12000), ephemeral_low)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    return free_port()


def varied(prompt: str) -> str:
    """Traffic from many callers: prompts that share no leading part, so that Envoy's prefix
    affinity spreads them over both replicas as least request would."""
    return f"{random.randrange(10**9)} {prompt}"


@dataclass
class Replica:
    """One service replica, restartable on the same ports; logs JSON lines."""

    stack: TestStack
    metrics_port: int
    log: Path

    @classmethod
    def new(cls, log: Path, core: int) -> Replica:
        metrics_port = stable_port()
        stack = TestStack(
            grpc_port=stable_port(),
            service_args=[
                *SMALL_ENGINE,
                # Each replica on a core of its own: vLLM's automatic binding would put both
                # on the same one, and one would starve.
                *("--cpu-cores", str(core)),
                "--metrics-port",
                str(metrics_port),
                "--shutdown-grace",
                str(GRACE),
                "--drain-delay",
                str(DRAIN_DELAY),
            ],
            env={"LOG_FORMAT": "json"},
            service_log=log,
            engine="multi-replica",
        )
        return cls(stack, metrics_port, log)

    @property
    def process(self) -> subprocess.Popen[bytes]:
        return self.stack.processes[0]

    @property
    def host(self) -> str:
        return self.stack.grpc_target

    def start(self) -> None:
        self.stack.start(with_envoy=False)

    def assert_running(self) -> None:
        code = self.process.poll()
        if code is not None:
            tail = self.log.read_text(errors="replace").splitlines()[-15:]
            raise AssertionError(f"{self.host} exited with code {code}:\n" + "\n".join(tail))

    def count(self, code: str) -> float:
        return sample(
            f"http://127.0.0.1:{self.metrics_port}/metrics",
            "llmcompletions_requests_total",
            method="CreateCompletion",
            code=code,
            tenant="",
        )

    def processes(self) -> list[psutil.Process]:
        """The server and its engine's processes."""
        main = psutil.Process(self.process.pid)
        return [main, *main.children(recursive=True)]

    def kill(self) -> None:
        """Every process of it, the engine's too (to clean up after a test)."""
        for process in reversed(self.processes()):
            process.kill()
        self.process.wait()

    def kill_server(self) -> list[psutil.Process]:
        """SIGKILL to the server alone, as the OOM killer sends it; its engine's processes."""
        engine = self.processes()[1:]
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()
        return engine

    def events(self, since: float) -> dict[str, float]:
        """When the server logged each of its messages (the first time) since `since`."""
        seen: dict[str, float] = {}
        for line in self.log.read_text(errors="replace").splitlines():
            if not line.startswith("{"):
                continue
            entry = json.loads(line)
            at = datetime.fromisoformat(entry["time"]).timestamp()
            if at >= since and entry.get("logger") == "service.transport.server":
                seen.setdefault(entry["message"].split(";")[0].split(" (")[0], at)
        return seen


@dataclass
class Outcome:
    kind: str
    started: float
    ended: float
    ok: bool
    detail: str = ""


class Traffic:
    """Clients sending requests through Envoy, each PAUSE after its last one ended (failed or
    not): REST (whole and streamed) and native gRPC (streamed). Besides, a short REST request
    every TICK seconds, whatever the others do, so that a replica that joins rotation is
    offered a request at once rather than when a client is next free. (Requests are in flight
    at almost every moment, and the replicas' cores, shared with the other shard's engines,
    are not kept busy throughout.)"""

    KINDS = ("rest", "rest-stream", "grpc-stream")
    TICK = 0.5
    PAUSE = 0.25  # between a client's requests

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.grpc_target = base_url.removeprefix("http://")
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(kind,), daemon=True) for kind in self.KINDS
        ]
        self._threads.append(threading.Thread(target=self._tick, daemon=True))
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=120)

    def _tick(self) -> None:
        with (
            httpx.Client(base_url=self.base_url, timeout=120) as rest,
            ThreadPoolExecutor(max_workers=16) as pool,
        ):
            while not self._stop.wait(self.TICK):
                pool.submit(self._one, "rest-tick", rest)

    def _one(self, kind: str, rest: httpx.Client) -> None:
        started = time.time()
        try:
            response = rest.post(
                "/v2/completions", json=body(prompt=varied("Hi"), max_tokens=4, ignore_eos=True)
            )
            ok, detail = response.status_code == 200, f"{response.status_code}"
        except httpx.HTTPError as error:
            ok, detail = False, f"{type(error).__name__}: {error}"[:300]
        self.outcomes.append(Outcome(kind, started, time.time(), ok, detail))

    def _run(self, kind: str) -> None:
        with (
            httpx.Client(base_url=self.base_url, timeout=120) as rest,
            grpc.insecure_channel(self.grpc_target) as channel,
        ):
            stub = completions_pb2_grpc.CompletionServiceStub(channel)
            while not self._stop.is_set():
                started = time.time()
                try:
                    ok, detail = self._call(kind, rest, stub)
                except (httpx.HTTPError, grpc.RpcError) as error:
                    ok, detail = False, f"{type(error).__name__}: {error}"[:300]
                self.outcomes.append(Outcome(kind, started, time.time(), ok, detail))
                time.sleep(self.PAUSE)

    @staticmethod
    def _call(
        kind: str, rest: httpx.Client, stub: completions_pb2_grpc.CompletionServiceStub
    ) -> tuple[bool, str]:
        fields = {"prompt": varied("Count:"), "max_tokens": TOKENS, "ignore_eos": True}
        if kind == "grpc-stream":
            messages = list(stub.CreateCompletion(grpc_request(stream=True, **fields), timeout=60))
            finished = [c.finish_reason for m in messages for c in m.choices if c.finish_reason]
            return finished == ["length"], f"finish reasons {finished}"
        if kind == "rest":
            response = rest.post("/v2/completions", json=body(**fields))
            return response.status_code == 200, f"{response.status_code} {response.text[:200]}"
        with rest.stream("POST", "/v2/completions", json=body(stream=True, **fields)) as response:
            lines = [line for line in response.iter_lines() if line]
        done = response.status_code == 200 and lines[-1:] == ["data: [DONE]"]
        return done and not any('"error"' in line for line in lines), f"{lines[-2:]}"

    def failures(self, since: float = 0.0, until: float = float("inf")) -> list[Outcome]:
        return [o for o in list(self.outcomes) if not o.ok and since <= o.started <= until]

    def failed_after(self, moment: float) -> list[Outcome]:
        return [o for o in list(self.outcomes) if not o.ok and o.ended >= moment]

    def started_between(self, since: float, until: float) -> list[Outcome]:
        return [o for o in list(self.outcomes) if since <= o.started <= until]


@dataclass
class Sample:
    at: float  # when the sample was complete
    serving: tuple[bool, ...]  # what each replica answers grpc.health.v1 Check
    healthy: tuple[bool, ...]  # whether Envoy has it in rotation
    routed: tuple[int, ...]  # requests Envoy has sent it (rq_total)
    active: tuple[int, ...]  # requests Envoy has in flight on it (rq_active)


@dataclass
class Watcher:
    """Polls each replica's health and Envoy's view of it, every POLL seconds."""

    replicas: list[Replica]
    admin_url: str
    samples: list[Sample] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        channels = [grpc.insecure_channel(replica.host) for replica in self.replicas]
        stubs = [health_pb2_grpc.HealthStub(channel) for channel in channels]
        while not self.done.is_set():
            serving = tuple(self._serving(stub) for stub in stubs)
            hosts = self.hosts()
            # Stamped once all is read: what a sample shows held by then. Stamped before, a
            # sample of slow checks (a replica's server shares its core with its engine while
            # that warms up) would date Envoy's view a second early.
            at = time.time()
            views = [hosts.get(replica.host, {}) for replica in self.replicas]
            self.samples.append(
                Sample(
                    at,
                    serving,
                    tuple(view.get("health_flags") == "healthy" for view in views),
                    tuple(int(view.get("rq_total", 0)) for view in views),
                    tuple(int(view.get("rq_active", 0)) for view in views),
                )
            )
            time.sleep(POLL)
        for channel in channels:
            channel.close()

    @staticmethod
    def _serving(stub: health_pb2_grpc.HealthStub) -> bool:
        try:
            return stub.Check(health_pb2.HealthCheckRequest(), timeout=0.5).status == SERVING
        except grpc.RpcError:
            return False

    def hosts(self) -> dict[str, dict[str, str]]:
        """Envoy admin /clusters: each upstream host's requests, summed over the clusters of
        replicas (least request, and its twin balanced by prefix), and its health flags
        ("healthy" only when every cluster sees it healthy)."""
        try:
            text = httpx.get(f"{self.admin_url}/clusters", timeout=2).text
        except httpx.HTTPError:
            return {}
        hosts: dict[str, dict[str, str]] = {}
        for line in text.splitlines():
            parts = line.split("::")
            if len(parts) != 4 or parts[0] not in REPLICA_CLUSTERS:
                continue
            view = hosts.setdefault(parts[1], {})
            name, value = parts[2], parts[3]
            if name in ("rq_total", "rq_active"):
                view[name] = str(int(view.get(name, "0")) + int(value))
            elif name == "health_flags":
                view[name] = value if view.get(name, value) == value else "mixed"
        return hosts

    def wait_for(
        self,
        condition: Callable[[Sample], bool],
        after: float,
        timeout: float,
        running: Sequence[Replica] = (),
    ) -> Sample:
        """The first sample taken at or after `after` that meets `condition`; fails at once if
        one of the `running` replicas exits meanwhile."""
        deadline = time.time() + timeout
        checked = 0
        while True:
            samples = self.samples
            for index in range(checked, len(samples)):
                if samples[index].at >= after and condition(samples[index]):
                    return samples[index]
            checked = len(samples)
            for replica in running:
                replica.assert_running()
            assert time.time() < deadline, f"not within {timeout:.0f}s: {samples[-3:]}"
            time.sleep(POLL / 2)

    def latest(self) -> Sample:
        return self.samples[-1]


@dataclass
class Cluster:
    replicas: list[Replica]
    envoy: subprocess.Popen[bytes]
    admin_url: str
    started: float
    traffic: Traffic
    watcher: Watcher

    def ejections(self) -> int:
        text = httpx.get(
            f"{self.admin_url}/stats?filter=outlier_detection.ejections_enforced_total", timeout=5
        ).text
        return sum(int(line.rsplit(":", 1)[1]) for line in text.splitlines() if ":" in line)

    def wait_both_in_rotation(self, after: float = 0.0) -> Sample:
        return self.watcher.wait_for(
            lambda s: all(s.healthy), after, ENGINE_START_TIMEOUT, running=self.replicas
        )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Cluster]:
    logs = tmp_path_factory.mktemp("replicas")
    replicas = [Replica.new(logs / f"replica-{i}.log", core=i) for i in range(2)]
    http_port, admin_port = stable_port(), stable_port()
    command = [
        sys.executable,
        "-m",
        "facade.launch",
        "--http-port",
        str(http_port),
        "--admin-port",
        str(admin_port),
    ]
    for replica in replicas:
        command += ["--upstream", replica.host]
    # As in a fresh deploy: the replicas and Envoy start together, traffic from the start.
    started = time.time()
    for replica in replicas:
        replica.start()
    envoy = subprocess.Popen(command)
    admin_url = f"http://127.0.0.1:{admin_port}"
    watcher = Watcher(replicas, admin_url)
    threading.Thread(target=watcher.run, daemon=True).start()
    traffic = Traffic(f"http://127.0.0.1:{http_port}")
    try:
        yield Cluster(replicas, envoy, admin_url, started, traffic, watcher)
    finally:
        traffic.stop()
        watcher.done.set()
        stop_helpers([envoy])
        for replica in replicas:
            if replica.process.poll() is None:
                replica.kill()


def left_behind(processes: list[psutil.Process]) -> list[psutil.Process]:
    """Those of a killed server's processes that outlived it: its engine's, a few seconds on,
    then any (multiprocessing's resource tracker leaves once they are torn down)."""
    engine = [process for process in processes if is_engine(process)]
    return left_running(engine, ENGINE_GONE_SECONDS) or left_running(
        processes, TRACKER_GONE_SECONDS
    )


def envoy_ready(admin_url: str) -> bool:
    try:
        return httpx.get(f"{admin_url}/ready", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_replicas_join_rotation_within_seconds_of_serving(cluster: Cluster) -> None:
    deadline = time.time() + 30
    while not envoy_ready(cluster.admin_url):
        assert time.time() < deadline, "Envoy not ready"
        time.sleep(POLL)
    envoy_up = time.time()
    joins = []
    for index, replica in enumerate(cluster.replicas):
        serving = cluster.watcher.wait_for(
            lambda s, i=index: s.serving[i],
            cluster.started,
            ENGINE_START_TIMEOUT,
            running=[replica],
        )
        joined = cluster.watcher.wait_for(lambda s, i=index: s.healthy[i], cluster.started, 30)
        routed = cluster.watcher.wait_for(lambda s, i=index: s.routed[i] > 0, cluster.started, 30)
        deadline = time.time() + 60
        while replica.count("OK") == 0:
            assert time.time() < deadline, f"{replica.host} served nothing"
            time.sleep(POLL)
        served = time.time()
        joins.append(joined.at)
        print(
            f"\nreplica {index}: SERVING {serving.at - cluster.started:.1f}s after start; "
            f"in rotation {joined.at - serving.at:+.1f}s, first request routed "
            f"{routed.at - serving.at:+.1f}s, first completion {served - serving.at:+.1f}s "
            "after SERVING"
        )
        assert envoy_up < serving.at, "Envoy should have been up before the replica loaded"
        assert joined.at - serving.at <= JOIN_WITHIN
        assert routed.at - serving.at <= JOIN_WITHIN + Traffic.TICK
        # Nothing was routed to it while it loaded: it never answered a completion call.
        assert replica.count("UNAVAILABLE") == 0
    # Before any replica was SERVING clients got Envoy's 503 at once; once one was, none
    # failed (the other one, still loading, got no traffic).
    time.sleep(2)
    assert cluster.traffic.failures(since=min(joins) + 1) == []
    assert cluster.ejections() == 0


def engine_process(replica: Replica, name: str) -> psutil.Process:
    (found,) = [p for p in replica.processes() if p.name() == name]
    return found


def bound_cores(replica: Replica) -> set[int]:
    """The cores the replica's engine binds its threads to, one core a thread (its worker runs
    in the engine-core process)."""
    engine_core = engine_process(replica, "VLLM::EngineCore")
    return set().union(*(cores for cores in thread_affinities(engine_core) if len(cores) == 1))


def test_each_replica_runs_on_its_own_core(cluster: Cluster) -> None:
    cluster.wait_both_in_rotation()
    assert [bound_cores(replica) for replica in cluster.replicas] == [{0}, {1}]
    # Every thread of the engine core, which runs the worker, stays on the replica's core; no
    # worker process of its own runs anywhere.
    for replica, core in zip(cluster.replicas, ({0}, {1}), strict=True):
        assert not [p for p in replica.processes() if p.name() == "VLLM::Worker"], replica.host
        engine_core = engine_process(replica, "VLLM::EngineCore")
        assert all(cores == core for cores in thread_affinities(engine_core)), replica.host


def test_a_drain_lasts_as_long_as_its_longest_request(cluster: Cluster) -> None:
    replica = cluster.replicas[0]
    cluster.wait_both_in_rotation()
    engine = replica.processes()[1:]
    # What used to hold a drain open until the grace period ran out: a client connection
    # that stays silent (never answers the server's GOAWAY ping) and a health Watch stream.
    silent = socket.create_connection(("127.0.0.1", replica.stack.grpc_port))
    silent.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))
    watch_channel = grpc.insecure_channel(replica.host)
    watch = health_pb2_grpc.HealthStub(watch_channel).Watch(health_pb2.HealthCheckRequest())
    assert next(watch).status == SERVING
    # A long stream straight to the replica, in flight when it closes its listener.
    channel = grpc.insecure_channel(replica.host)
    stream = completions_pb2_grpc.CompletionServiceStub(channel).CreateCompletion(
        grpc_request(prompt="Count:", max_tokens=LONG_TOKENS, ignore_eos=True, stream=True),
        timeout=120,
    )
    messages = [next(stream)]
    signalled = time.time()
    replica.process.send_signal(signal.SIGTERM)
    messages += list(stream)
    stream_ended = time.time()
    code = replica.process.wait(timeout=GRACE + 30)
    exited = time.time()
    events = replica.events(since=signalled - 1)
    closed, stopped = events["closing the listener"], events["stopped"]
    left = cluster.watcher.wait_for(lambda s: not s.healthy[0], signalled, 10)
    with pytest.raises(grpc.RpcError):
        list(watch)  # the Watch stream was ended, not left to the grace period
    silent.close()
    watch_channel.close()
    channel.close()
    print(
        f"\ndrain: out of rotation {left.at - signalled:.1f}s after SIGTERM, listener closed "
        f"{closed - signalled:.1f}s, longest request in flight ended {stream_ended - closed:.1f}s "
        f"after that, 'stopped' {stopped - signalled:.1f}s, exit {exited - signalled:.1f}s "
        f"({exited - stopped:.2f}s after 'stopped'); grace {GRACE:.0f}s"
    )
    assert code == 0
    assert left.at - signalled < DRAIN_DELAY, "Envoy should stop routing before the listener closes"
    tokens = sum(len(message.choices) for message in messages)
    assert tokens == LONG_TOKENS, "the stream in flight must finish, not be cancelled"
    assert messages[-1].choices[0].finish_reason == "length"
    assert closed - signalled == pytest.approx(DRAIN_DELAY, abs=0.5)
    assert stream_ended > closed, "the long stream should still run when the listener closes"
    # The drain ends with its last request (plus stopping the engine), not the grace period.
    assert stopped - stream_ended <= ServerSettings.engine_stop_seconds + 2.0
    # And it exits on its own once stopped: 0.1-0.2 s after 'stopped' in most runs; 6.5, 18
    # and 24.8 s on a host busy with the other shard's start-ups (the processes of several GiB
    # being torn down is part of it). From SIGTERM the whole took up to 60.4 s there, the long
    # stream itself 29.5 s of it: the stream's length is the host's, not the drain's.
    assert exited - stopped < EXIT_AFTER_STOPPED_SECONDS
    assert not left_behind(engine), "the engine outlived the server"
    assert cluster.traffic.failures(since=signalled - 1, until=exited + 1) == []


def test_a_restarted_replica_rejoins_within_seconds_of_serving(cluster: Cluster) -> None:
    replica = cluster.replicas[0]
    assert replica.process.poll() is not None, "drained by the test before"
    restarted = time.time()
    replica.start()  # the same gRPC and metrics ports: the drained process released them
    serving = cluster.watcher.wait_for(
        lambda s: s.serving[0], restarted, ENGINE_START_TIMEOUT, running=[replica]
    )
    joined = cluster.watcher.wait_for(lambda s: s.healthy[0], restarted, 30)
    routed_before = cluster.watcher.wait_for(lambda s: True, restarted, 5).routed[0]
    routed = cluster.watcher.wait_for(lambda s: s.routed[0] > routed_before, restarted, 30)
    deadline = time.time() + 60
    while replica.count("OK") == 0:
        assert time.time() < deadline, "the restarted replica served nothing"
        time.sleep(POLL)
    print(
        f"\nrestart: SERVING {serving.at - restarted:.1f}s after the restart, in rotation "
        f"{joined.at - serving.at:+.1f}s and first request routed {routed.at - serving.at:+.1f}s "
        "after SERVING"
    )
    assert joined.at - serving.at <= JOIN_WITHIN
    assert routed.at - serving.at <= JOIN_WITHIN + Traffic.TICK
    assert replica.count("UNAVAILABLE") == 0, "requests reached it while it loaded"
    assert cluster.traffic.failures(since=restarted, until=time.time()) == []
    assert cluster.ejections() == 0


def test_a_killed_replica_costs_only_the_requests_in_flight_on_it(cluster: Cluster) -> None:
    """The victim is a replica with requests in flight: which one has them depends on the
    picker (a restarted replica is home to the new prompts until it holds as many as the
    other)."""
    cluster.wait_both_in_rotation()
    busy = cluster.watcher.wait_for(
        lambda s: max(s.active) > 0, time.time(), 30, running=cluster.replicas
    )
    index = busy.active.index(max(busy.active))
    victim = cluster.replicas[index]
    in_flight = cluster.watcher.hosts()[victim.host]["rq_active"]
    killed = time.time()
    engine = victim.kill_server()
    dead = time.time()  # SIGKILL takes a moment: requests sent until then may reach it
    # The engine's processes die with the server (the kernel signals them), and its port is
    # free at once for a replica started in its place.
    assert not left_behind(engine), "the engine outlived the server"
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", victim.stack.grpc_port))
        sock.listen()
    out = cluster.watcher.wait_for(lambda s: not s.healthy[index], killed, 10)
    time.sleep(KILL_SETTLE + 10)
    failed = cluster.traffic.failed_after(killed)
    racing = cluster.traffic.started_between(killed, dead)
    later = cluster.traffic.started_between(killed + KILL_SETTLE, time.time() - 3)
    print(
        f"\nkill: {in_flight} requests in flight on it ({busy.active[index]} a moment before), "
        f"{len(racing)} sent while it died, {len(failed)} failed; out of rotation "
        f"{out.at - killed:.1f}s after SIGKILL; "
        f"{len(later)} requests sent {KILL_SETTLE:.0f}s or more after it all succeeded"
    )
    # Only requests in flight on the killed replica failed: started before it was dead, ended
    # after the kill.
    assert all(o.started < dead and killed <= o.ended for o in failed), failed
    assert len(failed) <= int(in_flight) + len(racing), failed
    assert later and all(o.ok for o in later)
