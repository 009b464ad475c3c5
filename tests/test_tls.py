"""TLS on every hop, with certificates made here: callers reach the replica over mutual TLS
(native gRPC, health, reflection) and Envoy over TLS (REST and gRPC); Envoy reaches the replica
over mutual TLS, health checks included, and refuses a replica whose certificate names another
host; a caller without a trusted client certificate is refused; certificates updated as the
kubelet updates a mounted Secret are used without a restart. Tests run in file order; the last
one rotates the certificates."""

from __future__ import annotations

import contextlib
import os
import shutil
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import grpc
import httpx
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from llmcompletions.client import CompletionClient, Tls
from llmcompletions.v2 import completions_pb2_grpc

from facade import render
from facade.balancing import PrefixAffinity
from facade.pools import Pool
from facade.tls import UpstreamTls
from plumbing.tls import TlsSettings
from tests.certificates import CertificateAuthority, KeyPair
from tests.conftest import ENGINE_START_TIMEOUT, MODEL, SMALL_ENGINE
from tests.helpers import CAPITAL_PROMPT, body, grpc_request
from tests.processes import (
    TestStack,
    clean_environment,
    envoy_counter,
    free_port,
    healthy_upstreams,
    stop_helpers,
)

T = TypeVar("T")
GRPCURL = Path(sys.executable).parent / "grpcurl"
REFUSED = (grpc.StatusCode.UNAVAILABLE,)


@dataclass
class Pki:
    directory: Path
    servers: CertificateAuthority  # signs the replica's and Envoy's certificates
    next_servers: CertificateAuthority  # the CA the rotation moves to
    clients: CertificateAuthority  # signs callers' (and Envoy's) client certificates
    server: KeyPair  # the replica's and Envoy's listener certificate (one pair of files)
    envoy_client: KeyPair
    caller: KeyPair
    stranger: KeyPair  # a client certificate from a CA nobody trusts
    trusted_servers: Path  # both server CAs, as Envoy trusts them across the rotation

    def caller_tls(self, ca_file: Path | None = None) -> Tls:
        return Tls(ca_file or self.servers.cert_file, self.caller.cert_file, self.caller.key_file)


def mount_secret(directory: Path, pair: KeyPair, version: str) -> None:
    """`pair` as server.crt and server.key in `directory`, as the kubelet mounts and updates a
    Secret: the files in a directory of their own, `..data` linked to it (an update links it to
    the next one at once, then removes the old), each file's name linked through `..data`."""
    files = directory / f"..{version}"
    files.mkdir()
    for path in (pair.cert_file, pair.key_file):
        path.rename(files / f"server{path.suffix}")
    data = directory / "..data"
    previous = data.resolve() if data.exists() else None
    staged = directory / "..data_tmp"
    staged.symlink_to(files.name)
    os.replace(staged, data)
    for name in ("server.crt", "server.key"):
        if not (directory / name).is_symlink():
            (directory / name).symlink_to(f"..data/{name}")
    if previous is not None:
        shutil.rmtree(previous)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    directory = tmp_path_factory.mktemp("pki")
    served = directory / "served"  # the directory a Secret is mounted at
    served.mkdir()
    servers = CertificateAuthority(directory, "servers CA")
    next_servers = CertificateAuthority(directory, "next servers CA")
    clients = CertificateAuthority(directory, "clients CA")
    strangers = CertificateAuthority(directory, "strangers CA")
    trusted = directory / "trusted-servers.crt"
    trusted.write_bytes(servers.cert_file.read_bytes() + next_servers.cert_file.read_bytes())
    mount_secret(served, servers.server("server"), "v1")
    return Pki(
        directory=directory,
        servers=servers,
        next_servers=next_servers,
        clients=clients,
        server=KeyPair(served / "server.crt", served / "server.key"),
        envoy_client=clients.client("envoy"),
        caller=clients.client("caller"),
        stranger=strangers.client("stranger"),
        trusted_servers=trusted,
    )


@pytest.fixture(scope="module")
def tls_stack(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestStack]:
    """The replica requires client certificates; Envoy serves TLS without requiring them."""
    running = TestStack(
        grpc_port=free_port(),
        http_port=free_port(),
        admin_port=free_port(),
        service_args=[
            *SMALL_ENGINE,
            *("--metrics-port", str(free_port())),
            *("--tls-client-ca-file", str(pki.clients.cert_file)),
        ],
        env={
            "TLS_CERT_FILE": str(pki.server.cert_file),
            "TLS_KEY_FILE": str(pki.server.key_file),
            "UPSTREAM_CA_FILE": str(pki.trusted_servers),
            "UPSTREAM_CERT_FILE": str(pki.envoy_client.cert_file),
            "UPSTREAM_KEY_FILE": str(pki.envoy_client.key_file),
        },
        service_log=tmp_path_factory.mktemp("tls") / "service.log",
        engine="tls",
    )
    with running.running(ENGINE_START_TIMEOUT):
        yield running


def grpc_health(target: str, credentials: grpc.ChannelCredentials | None) -> int:
    channel = (
        grpc.secure_channel(target, credentials)
        if credentials is not None
        else grpc.insecure_channel(target)
    )
    with channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
    return reply.status


def credentials(ca: Path, client: KeyPair | None = None) -> grpc.ChannelCredentials:
    pair = (client.key_file.read_bytes(), client.cert_file.read_bytes()) if client else ()
    return grpc.ssl_channel_credentials(ca.read_bytes(), *pair)


def envoy_stats(stack: TestStack) -> dict[str, int]:
    url = f"http://127.0.0.1:{stack.admin_port}/stats?filter=^cluster.completion_service."
    with urllib.request.urlopen(url, timeout=5) as reply:
        lines = reply.read().decode().splitlines()
    counters = (line.partition(": ") for line in lines)
    return {name: int(value) for name, _, value in counters if value.isdigit()}


def ssl_context(ca: Path, client: KeyPair | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(ca))
    if client is not None:
        context.load_cert_chain(client.cert_file, client.key_file)
    return context


def test_grpc_callers_use_mutual_tls_for_completions_health_and_reflection(
    tls_stack: TestStack, pki: Pki
) -> None:
    with CompletionClient(tls_stack.grpc_target, tls=pki.caller_tls(), timeout=60) as client:
        reply = client.complete(model=MODEL, prompt=CAPITAL_PROMPT, max_tokens=4, temperature=0)
        streamed = "".join(
            chunk.choices[0].text
            for chunk in client.stream(
                model=MODEL, prompt=CAPITAL_PROMPT, max_tokens=4, temperature=0
            )
            if chunk.choices
        )
    assert reply.choices[0].text and streamed == reply.choices[0].text
    caller = credentials(pki.servers.cert_file, pki.caller)
    assert grpc_health(tls_stack.grpc_target, caller) == health_pb2.HealthCheckResponse.SERVING
    listed = subprocess.run(
        [
            str(GRPCURL),
            *("-cacert", str(pki.servers.cert_file)),
            *("-cert", str(pki.caller.cert_file), "-key", str(pki.caller.key_file)),
            *(tls_stack.grpc_target, "list"),
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert "llmcompletions.v2.CompletionService" in listed.stdout.split()


@pytest.mark.parametrize("who", ["no client certificate", "an untrusted one", "plaintext"])
def test_a_caller_without_a_trusted_client_certificate_is_refused(
    tls_stack: TestStack, pki: Pki, who: str
) -> None:
    presented = {
        "no client certificate": credentials(pki.servers.cert_file),
        "an untrusted one": credentials(pki.servers.cert_file, pki.stranger),
        "plaintext": None,
    }[who]
    with pytest.raises(grpc.RpcError) as refused:
        grpc_health(tls_stack.grpc_target, presented)
    assert refused.value.code() in REFUSED


def test_rest_and_grpc_through_envoy_over_tls(tls_stack: TestStack, pki: Pki) -> None:
    assert tls_stack.base_url.startswith("https://")
    ca = ssl_context(pki.servers.cert_file)
    with httpx.Client(base_url=tls_stack.base_url, verify=ca, timeout=60) as rest:
        whole = rest.post(
            "/v2/completions", json=body(prompt=CAPITAL_PROMPT, max_tokens=4)
        ).raise_for_status()
        with rest.stream(
            "POST", "/v2/completions", json=body(prompt=CAPITAL_PROMPT, max_tokens=4, stream=True)
        ) as streamed:
            events = [line for line in streamed.iter_lines() if line.startswith("data: ")]
    assert whole.json()["choices"][0]["text"]
    assert events[-1] == "data: [DONE]"
    envoy = f"127.0.0.1:{tls_stack.http_port}"
    with grpc.secure_channel(envoy, credentials(pki.servers.cert_file)) as channel:
        stub = completions_pb2_grpc.CompletionServiceStub(channel)
        (reply,) = stub.CreateCompletion(
            grpc_request(prompt=CAPITAL_PROMPT, max_tokens=4), timeout=60
        )
    assert reply.choices[0].text == whole.json()["choices"][0]["text"]
    with pytest.raises(httpx.HTTPError):  # plaintext on the TLS listener
        httpx.get(f"http://{envoy}/v2/models", timeout=5)


def test_envoy_reaches_the_replica_and_health_checks_it_over_mutual_tls(
    tls_stack: TestStack,
) -> None:
    stats = envoy_stats(tls_stack)
    assert stats["cluster.completion_service.ssl.handshake"] >= 1
    assert stats["cluster.completion_service.health_check.success"] >= 1
    assert stats["cluster.completion_service.ssl.connection_error"] == 0


@contextlib.contextmanager
def health_server(pair: KeyPair) -> Iterator[int]:
    """A gRPC health service over TLS with `pair`, SERVING, as a replica answers Envoy's checks;
    its port."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    credentials = grpc.ssl_server_credentials(
        [(pair.key_file.read_bytes(), pair.cert_file.read_bytes())]
    )
    port = server.add_secure_port(f"127.0.0.1:{free_port()}", credentials)
    server.start()
    try:
        yield port
    finally:
        server.stop(grace=None)


def refusals(admin_url: str) -> int:
    """How many replica certificates Envoy refused for naming another host."""
    return envoy_counter(admin_url, "cluster.completion_service.ssl.fail_verify_san")


@pytest.mark.parametrize("named", ["localhost", "elsewhere.test"])
def test_envoy_trusts_a_replica_only_with_a_certificate_for_its_host(
    pki: Pki, tmp_path: Path, named: str
) -> None:
    pair = pki.servers.server(f"named-{named}", by_ip=False, dns_name=named)
    http_port, admin_port = free_port(), free_port()
    admin_url = f"http://127.0.0.1:{admin_port}"
    with health_server(pair) as port:
        command = [sys.executable, "-m", "facade.launch", "--upstream", f"localhost:{port}"]
        command += ["--http-port", str(http_port), "--admin-port", str(admin_port)]
        command += ["--upstream-ca-file", str(pki.servers.cert_file)]
        envoy = subprocess.Popen(command, cwd=tmp_path, env=clean_environment())
        try:
            # Envoy checks health every 2 s over TLS: the first check decides.
            deadline = time.monotonic() + 30
            while not (healthy_upstreams(admin_url, "completion_service") or refusals(admin_url)):
                assert envoy.poll() is None, f"Envoy exited ({envoy.returncode})"
                assert time.monotonic() < deadline, "Envoy neither trusted nor refused it"
                time.sleep(0.5)
            trusted = bool(healthy_upstreams(admin_url, "completion_service"))
            assert (trusted, refusals(admin_url) > 0) == (
                named == "localhost",
                named != "localhost",
            )
        finally:
            stop_helpers([envoy])


def test_envoy_can_require_client_certificates(tls_stack: TestStack, pki: Pki) -> None:
    """A second Envoy in front of the same replica, whose listener requires them."""
    envoy = TestStack(
        grpc_port=tls_stack.grpc_port,
        http_port=free_port(),
        admin_port=free_port(),
        env={**(tls_stack.env or {}), "TLS_CLIENT_CA_FILE": str(pki.clients.cert_file)},
    )
    envoy.processes = [subprocess.Popen(envoy.envoy_command(), env=envoy.environment)]
    try:
        envoy.wait_until(lambda: envoy.envoy_ready() and envoy.upstream_healthy(), timeout=60)
        caller = ssl_context(pki.servers.cert_file, pki.caller)
        with httpx.Client(base_url=envoy.base_url, verify=caller, timeout=60) as rest:
            listed = rest.get("/v2/models").raise_for_status().json()
        assert [model["id"] for model in listed["data"]] == [MODEL]
        with pytest.raises(httpx.HTTPError):
            httpx.get(
                f"{envoy.base_url}/v2/models", verify=ssl_context(pki.servers.cert_file), timeout=5
            )
    finally:
        envoy.stop()


def eventually(attempt: Callable[[], T], timeout: float = 10.0) -> T:
    """The first success of `attempt`, retried while a rotation settles."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return attempt()
        except (grpc.RpcError, httpx.HTTPError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_rotated_certificates_are_used_without_a_restart(tls_stack: TestStack, pki: Pki) -> None:
    before = tls_stack.processes[0].pid
    mount_secret(pki.server.cert_file.parent, pki.next_servers.server("rotated"), "v2")
    new_ca = pki.next_servers.cert_file
    status = eventually(lambda: grpc_health(tls_stack.grpc_target, credentials(new_ca, pki.caller)))
    assert status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError):  # the old certificate is gone for new connections
        grpc_health(tls_stack.grpc_target, credentials(pki.servers.cert_file, pki.caller))

    def rest_with_new_ca() -> httpx.Response:
        with httpx.Client(
            base_url=tls_stack.base_url, verify=ssl_context(new_ca), timeout=60
        ) as rest:
            return rest.post(
                "/v2/completions", json=body(prompt=CAPITAL_PROMPT, max_tokens=2)
            ).raise_for_status()

    assert eventually(rest_with_new_ca).json()["choices"][0]["text"]
    assert tls_stack.processes[0].pid == before and tls_stack.processes[0].poll() is None


def test_envoy_accepts_tls_with_several_pools(pki: Pki, tmp_path: Path) -> None:
    config = render.render_config(free_port(), free_port(), [("127.0.0.1", 1)])
    pools = [Pool(name, (("127.0.0.1", port),), (name,)) for name, port in (("a", 1), ("b", 2))]
    render.configure_routing(config, pools, "", PrefixAffinity())
    listener = TlsSettings(pki.server.cert_file, pki.server.key_file, pki.clients.cert_file)
    upstream = UpstreamTls(
        pki.trusted_servers, pki.envoy_client.cert_file, pki.envoy_client.key_file
    )
    render.apply_tls(config, listener, upstream, tmp_path)
    command = render.envoy_command(render.write_config(config, tmp_path))
    checked = subprocess.run(
        [*command, "--mode", "validate"], capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stderr[-2000:]
