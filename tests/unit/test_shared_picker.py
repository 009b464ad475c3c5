"""A replica picker shared by several Envoys: it resolves the replicas' addresses as Envoy
does and checks their health itself, against real gRPC health services in this process: a
replica is in at its first SERVING answer, out at once on NOT_SERVING, out after two checks
without an answer, and back when it answers again; a name that stops resolving keeps its last
replicas, with one line in the log."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from facade.addresses import host_name, parse_address, resolve
from facade.picker import health as picker_health
from facade.picker.fleet import Clusters
from facade.picker.health import UNANSWERED_LIMIT, ReplicaChecks
from facade.tls import UpstreamTls
from tests.certificates import CertificateAuthority
from tests.processes import free_port, port_open

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
CLUSTER = "completion_service_prefix"


def test_an_ip_stands_for_itself_and_a_name_for_what_it_resolves_to() -> None:
    assert resolve(("10.1.2.3", 50051)) == ["10.1.2.3:50051"]
    assert resolve(("::1", 50051)) == ["[::1]:50051"]
    assert resolve(("0:0:0:0:0:0:0:1", 50051)) == ["[::1]:50051"]  # as Envoy writes it
    assert resolve(("localhost", 50051)) == ["127.0.0.1:50051"]  # IPv4 first, as Envoy's
    assert resolve(("no-such-replica.invalid", 50051)) == []
    assert host_name("fe80::1", 1) == "[fe80::1]:1"


class Replica:
    """A gRPC health service on a port of loopback, as a replica serves it."""

    def __init__(self, credentials: grpc.ServerCredentials | None = None) -> None:
        self.servicer = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self.credentials = credentials

    async def start(self, status: int = SERVING) -> None:
        self.server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, self.server)
        address = f"127.0.0.1:{self.port}"
        if self.credentials is None:
            self.port = self.server.add_insecure_port(address)
        else:
            self.port = self.server.add_secure_port(address, self.credentials)
        await self.server.start()
        await self.servicer.set("", status)

    async def stop(self) -> None:
        assert self.server is not None
        await self.server.stop(grace=None)

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"


@contextlib.asynccontextmanager
async def running_replicas() -> AsyncIterator[list[Replica]]:
    started = [Replica(), Replica()]
    for replica in started:
        await replica.start()
    try:
        yield started
    finally:
        for replica in started:
            await replica.stop()


@contextlib.asynccontextmanager
async def checking(replicas: list[Replica]) -> AsyncIterator[ReplicaChecks]:
    checks = ReplicaChecks({CLUSTER: [("127.0.0.1", r.port) for r in replicas]})
    try:
        yield checks
    finally:
        await checks.close()


def healthy(view: Clusters, host: str) -> bool:
    return view[CLUSTER][host].healthy


def test_replicas_are_in_while_serving_and_out_on_not_serving() -> None:
    asyncio.run(in_while_serving_out_on_not_serving())


async def in_while_serving_out_on_not_serving() -> None:
    async with running_replicas() as replicas, checking(replicas) as checks:
        view = await checks.read()
        assert set(view[CLUSTER]) == {r.host for r in replicas}
        assert all(healthy(view, r.host) for r in replicas)
        await replicas[0].servicer.set("", NOT_SERVING)  # a replica draining
        view = await checks.check_all()
        assert not healthy(view, replicas[0].host)
        assert healthy(view, replicas[1].host)
        await replicas[0].servicer.set("", SERVING)
        assert healthy(await checks.check_all(), replicas[0].host)


def test_a_replica_that_stops_answering_is_out_after_two_checks_and_back_when_it_answers() -> None:
    asyncio.run(out_after_two_unanswered_checks())


async def out_after_two_unanswered_checks() -> None:
    async with running_replicas() as replicas, checking(replicas) as checks:
        gone = replicas[0]
        await checks.read()
        await gone.stop()
        for check in range(1, UNANSWERED_LIMIT + 1):
            view = await checks.check_all()
            # One check without an answer (a busy replica) keeps it; the limit takes it out.
            assert healthy(view, gone.host) is (check < UNANSWERED_LIMIT)
        assert healthy(view, replicas[1].host)
        await gone.start()  # restarted on the same port
        # Back at the first check it answers (on a busy host, reconnecting can outlast one).
        for _ in range(3):
            view = await checks.check_all()
            if not checks.unanswered[gone.host]:
                break
        assert healthy(view, gone.host)


def test_a_replica_not_yet_answering_is_not_healthy() -> None:
    asyncio.run(not_yet_answering())


async def not_yet_answering() -> None:
    checks = ReplicaChecks({CLUSTER: [("127.0.0.1", 9)]})  # nothing listens on port 9
    try:
        view = await checks.read()
        assert view == {CLUSTER: {"127.0.0.1:9": view[CLUSTER]["127.0.0.1:9"]}}
        assert not healthy(view, "127.0.0.1:9")
    finally:
        await checks.close()


def test_a_name_that_stops_resolving_keeps_its_last_replicas(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # One pool of two names: the first answers, fails twice (a moment's outage), then
    # answers with a new replica; the second answers throughout.
    answers = {
        ("replicas.svc", 9): iter([["10.0.0.1:9"], [], [], ["10.0.0.2:9"]]),
        ("more.svc", 9): iter([["10.0.1.1:9"]] * 4),
    }
    monkeypatch.setattr(picker_health, "resolve", lambda address: next(answers[address]))
    checks = ReplicaChecks({CLUSTER: [("replicas.svc", 9), ("more.svc", 9)]})

    async def lookups() -> list[set[str]]:
        seen = []
        for _ in range(4):
            await checks.resolve()
            seen.append(set(checks.hosts[CLUSTER]))
        return seen

    with caplog.at_level(logging.INFO, logger="facade.picker"):
        seen = asyncio.run(lookups())
    other = "10.0.1.1:9"
    assert seen == [
        {"10.0.0.1:9", other},
        {"10.0.0.1:9", other},
        {"10.0.0.1:9", other},
        {"10.0.0.2:9", other},
    ]
    # One line when it stops resolving (not one per lookup), one when it is back.
    assert [record.getMessage() for record in caplog.records] == [
        "replicas.svc:9 resolves to no address now; the picker keeps its last replicas "
        "(10.0.0.1:9)",
        "replicas.svc:9 resolves to 10.0.0.2:9",
    ]


def test_a_name_that_never_resolved_says_envoy_hashes_meanwhile(
    caplog: pytest.LogCaptureFixture,
) -> None:
    checks = ReplicaChecks({CLUSTER: [("no-such-replica.invalid", 9)]})
    with caplog.at_level(logging.WARNING, logger="facade.picker"):
        asyncio.run(checks.resolve())
    assert checks.hosts == {CLUSTER: {}}
    (line,) = [record.getMessage() for record in caplog.records]
    assert line == (
        "no-such-replica.invalid:9 resolves to no address yet; Envoy hashes its requests until "
        "it does"
    )


def test_replicas_that_require_mutual_tls_are_checked_over_it(tmp_path: Path) -> None:
    authority = CertificateAuthority(tmp_path)
    # Named as a Service names replicas, not by the IP the name resolves to.
    server, client = authority.server(by_ip=False), authority.client()
    credentials = grpc.ssl_server_credentials(
        [(server.key_file.read_bytes(), server.cert_file.read_bytes())],
        root_certificates=authority.cert_file.read_bytes(),
        require_client_auth=True,
    )
    with_client = UpstreamTls(authority.cert_file, client.cert_file, client.key_file)
    asyncio.run(
        checked_over_tls(Replica(credentials), with_client, UpstreamTls(authority.cert_file))
    )


async def checked_over_tls(replica: Replica, mutual: UpstreamTls, server_only: UpstreamTls) -> None:
    await replica.start()
    try:
        # By name, as a Service names replicas: the certificate names the host, not its IP.
        for tls, expected in ((mutual, True), (server_only, False)):
            checks = ReplicaChecks({CLUSTER: [("localhost", replica.port)]}, tls)
            try:
                view = await checks.read()
                await checks.check_all()  # a refused handshake counts as no answer: twice
                view = await checks.check_all()
                assert healthy(view, f"127.0.0.1:{replica.port}") is expected
            finally:
                await checks.close()
    finally:
        await replica.stop()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--socket", "/tmp/p.sock"], "--socket needs --admin-url"),
        (["--listen", "nowhere"], "expected HOST:PORT"),
        (["--socket", "/tmp/p.sock", "--listen", "127.0.0.1:1"], "not allowed with"),
        ([], "one of the arguments --socket --listen is required"),
        (["--listen", "127.0.0.1:1", "--tls-key-file", "/dev/null"], "go together"),
    ],
)
def test_the_picker_refuses_an_incomplete_command_line(argv: list[str], message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "facade.picker.server", *argv], capture_output=True, text=True
    )
    assert result.returncode == 2
    assert message in result.stderr


def test_a_second_picker_on_the_same_port_fails_instead_of_sharing_it() -> None:
    port = free_port()
    command = [sys.executable, "-m", "facade.picker.server", "--listen", f"127.0.0.1:{port}"]
    command += ["--upstream", "127.0.0.1:9"]
    first = subprocess.Popen(command, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not port_open(port):
            assert first.poll() is None and time.monotonic() < deadline, "no first picker"
            time.sleep(0.1)
        second = subprocess.run(command, capture_output=True, text=True, timeout=30)
        assert second.returncode != 0
        assert f"cannot listen on 127.0.0.1:{port}" in second.stderr
        assert first.poll() is None
    finally:
        first.terminate()
        first.wait(timeout=30)


def test_launch_refuses_a_shared_picker_without_prefix_balancing() -> None:
    result = subprocess.run(
        [
            sys.executable,
            *("-m", "facade.launch", "--balance", "least-request", "--picker", "127.0.0.1:1"),
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert "--picker is the picker of --balance prefix" in result.stderr


def test_picker_addresses_parse_as_replica_addresses() -> None:
    assert parse_address("llm-completions-picker:50061") == ("llm-completions-picker", 50061)
