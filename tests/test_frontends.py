"""One replica, two frontend processes over one engine core (`API_SERVER_COUNT=2`), on the
tiny model: both frontends and the engine core are copies of the replica's parent, Envoy
spreads streams over both, a cancel works whichever frontend it reaches, the
backlog bound holds for the replica, /metrics is one scrape of both, SIGTERM drains both and
leaves nothing, and a dead frontend or engine core takes the replica down cleanly. Two such
replicas, each behind an Envoy of its own, hold one tenant's budget in one Redis."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import httpx
import psutil
import pytest
from llmcompletions.client import CompletionClient
from llmcompletions.v2 import completions_pb2_grpc
from llmcompletions.v2.completions_pb2 import (
    CancelCompletionRequest,
    LoadLoraAdapterRequest,
    UnloadLoraAdapterRequest,
)

from service.api.tenants import hash_key
from tests.conftest import (
    API_KEY,
    AUTH_HEADERS,
    ENGINE_START_TIMEOUT,
    GRPC_AUTH,
    MODEL,
    OPERATOR_KEY,
    OTHER_API_KEY,
    SMALL_ENGINE,
)
from tests.helpers import CAPITAL_PROMPT, body, grpc_request
from tests.metrics import sample, scrape
from tests.models import ADAPTER_TARGETS
from tests.processes import TestStack, free_port, healthy_upstreams, left_running, stop_helpers
from tests.redis_server import RedisServer, start_redis

FRONTENDS = 2
BOUND = 6  # --max-num-queued-reqs: sequences waiting or running in the whole replica
LONG = {"prompt": "Count:", "max_tokens": 400, "ignore_eos": True, "stream": True}
OTHER_AUTH = (("authorization", f"Bearer {OTHER_API_KEY}"),)
UNFINISHED = "llmcompletions_engine_unfinished_requests"
GONE_SECONDS = 30


def start_replica(log: Path, with_envoy: bool, extra: tuple[str, ...] = ()) -> TestStack:
    ports = [free_port() for _ in range(FRONTENDS)]
    replica = TestStack(
        grpc_port=free_port(),
        http_port=free_port(),
        admin_port=free_port(),
        service_args=[
            *SMALL_ENGINE,
            *("--api-key", f"{API_KEY},{OTHER_API_KEY}"),
            *("--metrics-port", str(free_port())),
            *("--max-num-seqs", "4", "--max-num-queued-reqs", str(BOUND)),
            *extra,
        ],
        env={"API_SERVER_COUNT": str(FRONTENDS), "FRONTEND_PORTS": ",".join(map(str, ports))},
        service_log=log,
        engine="frontends",
    )
    replica.start(with_envoy)
    if with_envoy:
        replica.wait_ready(ENGINE_START_TIMEOUT)
    else:
        replica.wait_ready_service(ENGINE_START_TIMEOUT)
    return replica


def frontend_targets(replica: TestStack) -> list[str]:
    return replica.upstream_targets


ADAPTER = "a1"
DRAIN_SECONDS = 2  # --adapter-drain-seconds: how long an unloaded adapter's calls may run on
# A tenant of both replicas' tenants file, its requests a minute counted in their one Redis.
TEAM_KEY = "fleet-team-key-7771"
TEAM_RPM = 4


@pytest.fixture(scope="module")
def limits_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    redis = start_redis(tmp_path_factory.mktemp("limits") / "redis.log")
    try:
        yield redis
    finally:
        redis.stop()


@pytest.fixture(scope="module")
def tenants_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tenants file, beside the replicas' API keys."""
    tenants = tmp_path_factory.mktemp("tenants") / "tenants.yaml"
    key = f"{{id: fleet-team-1, sha256: {hash_key(TEAM_KEY)}}}"
    tenants.write_text(
        f"version: 1\ntenants:\n  fleet-team:\n    keys: [{key}]\n    limits: {{rpm: {TEAM_RPM}}}\n"
    )
    return tenants


@pytest.fixture(scope="module")
def tenants_args(tenants_file: Path, limits_store: RedisServer) -> tuple[str, ...]:
    """The tenants file, its limits kept in the module's Redis."""
    return ("--tenants-file", str(tenants_file), "--limits-store", limits_store.url)


@pytest.fixture(scope="module")
def replica(
    tmp_path_factory: pytest.TempPathFactory,
    adapter_dirs: dict[str, Path],
    tenants_args: tuple[str, ...],
) -> Iterator[TestStack]:
    """The module's replica, with Envoy, serving a LoRA adapter too (each frontend registers
    the adapters given at start; the engine core holds their weights), and adapters that come
    at runtime: from an adapter root, or loaded by the operator."""
    directory = tmp_path_factory.mktemp("frontends")
    lora = ("--lora-modules", f"{ADAPTER}={adapter_dirs[ADAPTER]}", "--max-loras", "1")
    lora += ADAPTER_TARGETS
    runtime = ("--adapter-root", str(directory / "root"), "--enable-adapter-loading")
    runtime += ("--adapter-drain-seconds", str(DRAIN_SECONDS))
    (directory / "root").mkdir()
    operator = ("--operator-api-key", OPERATOR_KEY)
    extra = (*lora, *runtime, *operator, *tenants_args)
    started = start_replica(directory / "service.log", True, extra)
    try:
        yield started
    finally:
        started.stop()


def served_by_frontend(replica: TestStack) -> dict[str, float]:
    counts = {str(index): 0.0 for index in range(FRONTENDS)}
    for (name, labels), value in scrape(replica.metrics_url).items():
        found = dict(labels)
        if name == "llmcompletions_requests_total" and found.get("code") == "OK":
            counts[found["frontend"]] += value
    return counts


def stream_through_envoy(replica: TestStack) -> list[str]:
    with httpx.Client(base_url=replica.base_url, headers=AUTH_HEADERS, timeout=120) as rest:
        events = []
        with rest.stream(
            "POST",
            "/v2/completions",
            json=body(prompt="Hi", max_tokens=8, stream=True, ignore_eos=True),
        ) as response:
            assert response.status_code == 200
            events = [line for line in response.iter_lines() if line.startswith("data: ")]
    return events


def test_the_frontends_and_engine_core_are_copies_of_the_replica_made_after_its_imports(
    replica: TestStack,
) -> None:
    """Each frontend, and the engine core, is one of the copies the parent made once it had
    imported torch and vLLM (its log names their pids): none started a new interpreter."""
    assert replica.service_log is not None
    log = replica.service_log.read_text(errors="replace")
    found = re.search(r"(\d+) cop(?:y|ies) of the server standing by \(pids ([\d,]+)\)", log)
    assert found, "the replica made no copies of itself"
    copies = {int(pid) for pid in found.group(2).split(",")}
    assert int(found.group(1)) == len(copies) == FRONTENDS + 1
    parent = psutil.Process(replica.processes[0].pid)
    titled = {child.pid: child.name() for child in parent.children()}
    frontends = {pid for pid, name in titled.items() if "Frontend_" in name}
    engine_cores = {pid for pid, name in titled.items() if "EngineCor" in name}
    assert len(frontends) == FRONTENDS and len(engine_cores) == 1, titled
    assert frontends | engine_cores == copies


def test_envoy_spreads_streams_over_both_frontends(replica: TestStack) -> None:
    before = served_by_frontend(replica)
    with ThreadPoolExecutor(BOUND - 2) as pool:  # within the backlog bound: none refused
        streams = list(pool.map(lambda _: stream_through_envoy(replica), range(24)))
    assert all(events[-1] == "data: [DONE]" for events in streams)
    after = served_by_frontend(replica)
    grew = {frontend: after[frontend] - before[frontend] for frontend in after}
    assert sum(grew.values()) == 24, grew  # one scrape counts every frontend's calls
    assert all(count >= 4 for count in grew.values()), f"streams per frontend: {grew}"


def test_the_typed_client_given_every_frontend_spreads_its_calls(replica: TestStack) -> None:
    """One client, one channel: with the frontends' addresses it sends its calls in turn."""
    addresses = ",".join(frontend_targets(replica))
    before = served_by_frontend(replica)
    with CompletionClient(f"ipv4:{addresses}", api_key=API_KEY) as client:
        replies = [client.complete(model=MODEL, prompt="Hi", max_tokens=2) for _ in range(8)]
    assert all(reply.choices[0].finish_reason for reply in replies)
    after = served_by_frontend(replica)
    grew = {frontend: after[frontend] - before[frontend] for frontend in after}
    # In turn once both connections are up (the first calls may find only one ready).
    assert sum(grew.values()) == 8 and min(grew.values()) >= 2, grew


def test_an_adapter_given_at_start_serves_the_same_through_either_frontend(
    replica: TestStack,
) -> None:
    """Greedy text of the adapter is the same whichever frontend serves it, and not the base
    model's."""
    replies = {}
    for target in frontend_targets(replica):
        with CompletionClient(target, api_key=API_KEY) as client:
            for model in (ADAPTER, MODEL):
                reply = client.complete(
                    model=model, prompt=CAPITAL_PROMPT, max_tokens=16, temperature=0
                )
                replies[(target, model)] = reply.choices[0].text
    first, second = frontend_targets(replica)
    assert replies[(first, ADAPTER)] == replies[(second, ADAPTER)]
    assert replies[(first, MODEL)] == replies[(second, MODEL)]
    assert replies[(first, ADAPTER)] != replies[(first, MODEL)]


def adapter_texts(replica: TestStack, model: str) -> list[str | grpc.StatusCode]:
    """Each frontend's greedy text for `model`, or the status it refused with."""
    texts: list[str | grpc.StatusCode] = []
    for target in frontend_targets(replica):
        with grpc.insecure_channel(target) as channel:
            stub = completions_pb2_grpc.CompletionServiceStub(channel)
            request = grpc_request(model=model, prompt=CAPITAL_PROMPT, max_tokens=16)
            try:
                (reply,) = stub.CreateCompletion(request, timeout=60, metadata=GRPC_AUTH)
                texts.append(reply.choices[0].text)
            except grpc.RpcError as error:
                texts.append(error.code())
    return texts


OPERATOR_AUTH = (("authorization", f"Bearer {OPERATOR_KEY}"),)


def staged_adapter(replica: TestStack, adapter_dirs: dict[str, Path], name: str) -> Path:
    """A copy of the adapter in a hidden (unserved) directory of the replica's root."""
    root = Path(replica.service_args[replica.service_args.index("--adapter-root") + 1])
    return Path(shutil.copytree(adapter_dirs[ADAPTER], root / name))


def load_adapter(target: str, name: str, path: Path) -> None:
    with grpc.insecure_channel(target) as channel:
        stub = completions_pb2_grpc.CompletionServiceStub(channel)
        load = LoadLoraAdapterRequest(lora_name=name, lora_path=str(path))
        stub.LoadLoraAdapter(load, metadata=OPERATOR_AUTH, timeout=120)


def unload_adapter(target: str, name: str) -> None:
    with grpc.insecure_channel(target) as channel:
        stub = completions_pb2_grpc.CompletionServiceStub(channel)
        unload = UnloadLoraAdapterRequest(lora_name=name)
        stub.UnloadLoraAdapter(unload, metadata=OPERATOR_AUTH, timeout=120)


def test_adapters_loaded_and_unloaded_at_runtime_reach_both_frontends(
    replica: TestStack, adapter_dirs: dict[str, Path]
) -> None:
    """A load or unload reaching one frontend is done by both (each keeps its own table of
    adapters over the one engine); one dropped into the root is served by both."""
    staged = staged_adapter(replica, adapter_dirs, ".staging")
    start_text = adapter_texts(replica, ADAPTER)[0]
    first, second = frontend_targets(replica)
    load_adapter(first, "runtime", staged)
    assert adapter_texts(replica, "runtime") == [start_text, start_text]
    unload_adapter(second, "runtime")
    assert adapter_texts(replica, "runtime") == [grpc.StatusCode.NOT_FOUND] * FRONTENDS
    shutil.copytree(staged, staged.parent / "dropped")
    assert adapter_texts(replica, "dropped") == [start_text, start_text]


def test_a_call_outlasting_an_unloads_drain_ends_naming_the_unload(
    replica: TestStack, adapter_dirs: dict[str, Path]
) -> None:
    """The unload reaches one frontend, the adapter's stream runs on the other: past the drain
    the stream ends with ABORTED naming the unload, and then the unload answers."""
    first, second = frontend_targets(replica)
    load_adapter(first, "draining", staged_adapter(replica, adapter_dirs, ".draining"))
    call = long_stream(second, f"frontends-{uuid.uuid4().hex}", model="draining")
    unloading = time.monotonic()
    unload_adapter(first, "draining")
    answered = time.monotonic() - unloading
    with pytest.raises(grpc.RpcError) as ended:
        list(call)
    assert ended.value.code() == grpc.StatusCode.ABORTED
    assert "`draining` was unloaded while this call ran" in (ended.value.details() or "")
    assert DRAIN_SECONDS <= answered < DRAIN_SECONDS + 30, answered
    wait_for_unfinished(replica, 0)


def test_the_engine_cores_way_to_each_frontend_stays_open_while_it_serves(
    replica: TestStack,
) -> None:
    """Each frontend's queues from the engine core are unix sockets the parent bound: their
    paths must stay while the replica serves (once they were unlinked as the launch ended, and
    a frontend whose queue the core had not reached yet never got its calls' tokens)."""
    frontends = [p for p in replica_processes(replica) if "Frontend_" in " ".join(p.cmdline())]
    assert len(frontends) == FRONTENDS
    for frontend in frontends:
        paths = [c.laddr for c in frontend.net_connections(kind="unix") if c.laddr]
        queues = [path for path in paths if not path.endswith(".sock")]  # not the siblings'
        assert queues, f"{frontend.cmdline()} listens on no engine queue"
        assert all(Path(path).exists() for path in queues), queues


def long_stream(target: str, request_id: str, auth: Any = GRPC_AUTH, **fields: Any) -> Any:
    channel = grpc.insecure_channel(target)
    stub = completions_pb2_grpc.CompletionServiceStub(channel)
    call = stub.CreateCompletion(
        grpc_request(**{**LONG, **fields}),
        timeout=120,
        metadata=(*auth, ("x-request-id", request_id)),
    )
    next(call)  # running in the engine
    return call


def cancel(target: str, request_id: str, auth: Any = GRPC_AUTH) -> Any:
    with grpc.insecure_channel(target) as channel:
        stub = completions_pb2_grpc.CompletionServiceStub(channel)
        return stub.CancelCompletion(
            CancelCompletionRequest(request_id=request_id), timeout=30, metadata=auth
        )


@pytest.mark.parametrize(("runs_on", "cancelled_on"), [(0, 1), (1, 0)])
def test_a_cancel_reaching_either_frontend_ends_the_stream(
    replica: TestStack, runs_on: int, cancelled_on: int
) -> None:
    targets = frontend_targets(replica)
    request_id = f"frontends-{uuid.uuid4().hex}"
    call = long_stream(targets[runs_on], request_id)
    with pytest.raises(grpc.RpcError) as forbidden:
        cancel(targets[cancelled_on], request_id, OTHER_AUTH)
    assert forbidden.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(grpc.RpcError) as unknown:
        cancel(targets[cancelled_on], f"unknown-{uuid.uuid4().hex}")
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    assert cancel(targets[cancelled_on], request_id).cancelled == 1
    with pytest.raises(grpc.RpcError) as ended:
        list(call)
    assert ended.value.code() == grpc.StatusCode.CANCELLED
    wait_for_unfinished(replica, 0)


def wait_for_unfinished(replica: TestStack, count: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while sample(replica.metrics_url, UNFINISHED) != count:
        assert time.monotonic() < deadline, f"the replica never had {count} unfinished requests"
        time.sleep(0.1)


def test_a_backlog_filled_through_one_frontend_refuses_on_the_other(replica: TestStack) -> None:
    targets = frontend_targets(replica)
    request_id = f"frontends-{uuid.uuid4().hex}"
    call = long_stream(targets[0], request_id, n=BOUND)
    with grpc.insecure_channel(targets[1]) as channel:
        stub = completions_pb2_grpc.CompletionServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            list(
                stub.CreateCompletion(
                    grpc_request(prompt="Hi", max_tokens=1), timeout=30, metadata=GRPC_AUTH
                )
            )
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"bound of {BOUND}" in (refused.value.details() or "")
    assert cancel(targets[1], request_id).cancelled == 1
    with pytest.raises(grpc.RpcError):
        list(call)
    wait_for_unfinished(replica, 0)


def test_metrics_are_one_scrape_of_both_frontends(replica: TestStack) -> None:
    targets = frontend_targets(replica)
    calls = [long_stream(target, f"frontends-{uuid.uuid4().hex}") for target in targets]
    try:
        wait_for_unfinished(replica, FRONTENDS)  # one in each, summed
        found = scrape(replica.metrics_url)
        assert found[("llmcompletions_capacity", (("limit", "max_num_queued_reqs"),))] == BOUND
        assert any(name.startswith("vllm:") for name, _ in found)
    finally:
        for call in calls:
            call.cancel()
    wait_for_unfinished(replica, 0)


def replica_processes(replica: TestStack) -> list[psutil.Process]:
    parent = psutil.Process(replica.processes[0].pid)
    return [parent, *parent.children(recursive=True)]


DOCUMENTS = {
    name: f"Notes on {name}. " + " ".join(f"Item {i} of {name} is {i * 7}." for i in range(30))
    for name in ("apples", "rivers")
}


@contextlib.contextmanager
def prefix_envoy(replicas: list[TestStack]) -> Iterator[str]:
    """Envoy with the picker (prefix balancing, its default for several replicas) in front of
    two-frontend replicas, each given as 127.0.0.1:PORT+PORT; its base URL once it sees every
    frontend healthy."""
    http_port, admin_port = free_port(), free_port()
    command = [sys.executable, "-m", "facade.launch", "--debug-headers"]
    command += ["--http-port", str(http_port), "--admin-port", str(admin_port)]
    for replica in replicas:
        command += ["--upstream", replica.upstream_replica]
    envoy = subprocess.Popen(command)
    try:
        admin = f"http://127.0.0.1:{admin_port}"
        frontends = {target for replica in replicas for target in replica.upstream_targets}
        deadline = time.monotonic() + 60
        while healthy_upstreams(admin, "completion_service_prefix") != frontends:
            assert time.monotonic() < deadline, "Envoy never saw every frontend healthy"
            time.sleep(0.5)
        time.sleep(1)  # the picker reads Envoy's view every 250 ms
        yield f"http://127.0.0.1:{http_port}"
    finally:
        stop_helpers([envoy])


def served_by(base_url: str, document: str, questions: int) -> list[str]:
    """The frontend (x-upstream-host) that served each of `questions` calls on one document,
    sent at once (each a few seconds long, so that they overlap)."""

    def ask(number: int) -> str:
        prompt = f"{DOCUMENTS[document]}\nQuestion {number}: what is item {number}?"
        request = body(prompt=prompt, max_tokens=24, ignore_eos=True)
        with httpx.Client(base_url=base_url, headers=AUTH_HEADERS, timeout=120) as rest:
            reply = rest.post("/v2/completions", json=request)
        assert reply.status_code == 200, reply.text
        return reply.headers["x-upstream-host"]

    with ThreadPoolExecutor(questions) as pool:
        return list(pool.map(ask, range(questions)))


def team_call(base_url: str) -> httpx.Response:
    payload = body(prompt="Hi", max_tokens=1)
    headers = {"Authorization": f"Bearer {TEAM_KEY}"}
    return httpx.post(f"{base_url}/v2/completions", json=payload, headers=headers, timeout=60)


def store_errors(replica: TestStack) -> float:
    found = scrape(replica.metrics_url).items()
    return sum(v for (name, _), v in found if name == "llmcompletions_limits_store_errors_total")


def test_a_tenants_rpm_holds_across_two_replicas_behind_two_envoys_sharing_redis(
    replica: TestStack, doomed: dict[str, TestStack], limits_store: RedisServer
) -> None:
    """The tenant's calls alternate between the replicas' Envoys: each reply's remaining count
    goes on from the other replica's, the budget is spent in total (not per replica, nor per
    frontend), and both refuse the next call. With Redis gone, calls pass on both, and each
    replica counts the store's errors."""
    pair = [replica, doomed["EngineCore"]]
    served = [team_call(pair[i % 2].base_url) for i in range(TEAM_RPM)]
    assert [reply.status_code for reply in served] == [200] * TEAM_RPM, served[-1].text
    remaining = [int(reply.headers["x-ratelimit-remaining-requests"]) for reply in served]
    assert remaining == list(reversed(range(TEAM_RPM))), remaining
    for refused in (team_call(r.base_url) for r in pair):
        assert refused.status_code == 429, refused.text
        assert 1 <= int(refused.headers["retry-after"]) <= 60
    before = [store_errors(r) for r in pair]
    limits_store.stop()
    assert [team_call(r.base_url).status_code for r in pair] == [200, 200]  # fails open
    after = [store_errors(r) for r in pair]
    assert all(now > then for now, then in zip(after, before, strict=True)), (before, after)


def team_grpc_call(target: str) -> tuple[grpc.StatusCode, dict[str, str]]:
    """The tenant's call to one frontend: its status, and its reply's headers."""
    with grpc.insecure_channel(target) as channel:
        stub = completions_pb2_grpc.CompletionServiceStub(channel)
        auth = (("authorization", f"Bearer {TEAM_KEY}"),)
        call = stub.CreateCompletion(
            grpc_request(prompt="Hi", max_tokens=1), timeout=60, metadata=auth
        )
        try:
            list(call)
        except grpc.RpcError as error:
            return error.code(), {}
        return grpc.StatusCode.OK, {k: str(v) for k, v in call.initial_metadata()}


def test_a_tenants_rpm_held_in_memory_counts_both_frontends_of_the_replica(
    doomed: dict[str, TestStack],
) -> None:
    """memory:// with two frontends: the calls alternate between them, and the remaining count
    goes on from one to the other (the parent holds the windows), so the budget is the
    replica's, not each frontend's."""
    targets = frontend_targets(doomed["Frontend_1"])
    served = [team_grpc_call(targets[i % 2]) for i in range(TEAM_RPM)]
    assert [code for code, _ in served] == [grpc.StatusCode.OK] * TEAM_RPM
    remaining = [int(headers["x-ratelimit-remaining-requests"]) for _, headers in served]
    assert remaining == list(reversed(range(TEAM_RPM))), remaining
    refused = [team_grpc_call(target)[0] for target in targets]
    assert refused == [grpc.StatusCode.RESOURCE_EXHAUSTED] * FRONTENDS


def test_the_picker_keeps_a_document_on_one_replica_and_spreads_it_over_its_frontends(
    replica: TestStack, doomed: dict[str, TestStack]
) -> None:
    """Two replicas of two frontends each: a document's calls stay on one replica (one
    engine, one cache) and share its frontends; the next document goes to the other."""
    pair = [replica, doomed["EngineCore"]]
    frontends_of = {target: index for index, r in enumerate(pair) for target in r.upstream_targets}
    with prefix_envoy(pair) as base_url:
        first = served_by(base_url, "apples", 4)
        second = served_by(base_url, "rivers", 4)
    home = {frontends_of[host] for host in first}
    assert len(home) == 1, f"one document's calls went to both replicas: {first}"
    assert len(set(first)) == FRONTENDS, f"the replica's frontends did not share them: {first}"
    assert {frontends_of[host] for host in second} == {0, 1} - home, second


def test_sigterm_drains_the_streams_of_both_frontends_and_leaves_nothing(
    replica: TestStack,
) -> None:
    """Last in the module to use the shared replica: it drains it under streaming traffic (to
    each frontend, and through Envoy), then starts it again at once on the same ports, as a
    supervisor would: the drained connections left in TIME_WAIT must not keep it out."""
    targets = frontend_targets(replica)
    calls = [
        long_stream(target, f"frontends-{uuid.uuid4().hex}", max_tokens=40) for target in targets
    ]
    with httpx.Client(base_url=replica.base_url, headers=AUTH_HEADERS, timeout=120) as rest:
        short = body(**LONG) | {"max_tokens": 40}
        through_envoy = rest.stream("POST", "/v2/completions", json=short)
        with through_envoy as streamed:
            lines = streamed.iter_lines()
            assert next(lines).startswith("data: "), "running in the engine"
            processes = replica_processes(replica)
            replica.processes[0].send_signal(signal.SIGTERM)
            events = [line.removeprefix("data: ") for line in lines if line]
    for call in calls:
        rest_of_call = list(call)
        assert rest_of_call[-1].choices[0].finish_reason == "length", "the stream must finish"
    assert events[-1] == "[DONE]", "the stream through Envoy must finish"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    assert replica.processes[0].wait(timeout=60) == 0
    assert left_running(processes, GONE_SECONDS) == []

    ports = [replica.grpc_port, *(int(target.rpartition(":")[2]) for target in targets)]
    lingering = [
        connection
        for connection in psutil.net_connections("tcp")
        if connection.status == psutil.CONN_TIME_WAIT and connection.laddr.port in ports
    ]
    assert lingering, "the drain left no connection in TIME_WAIT: this restart proves nothing"
    envoy = replica.processes[1]
    replica.start(with_envoy=False)  # the same service, on the same ports, at once
    replica.processes.append(envoy)
    try:
        replica.wait_ready(ENGINE_START_TIMEOUT)
        answer = httpx.post(
            f"{replica.base_url}/v2/completions",
            json=body(prompt=CAPITAL_PROMPT, max_tokens=4),
            headers=AUTH_HEADERS,
            timeout=60,
        )
        assert answer.status_code == 200, answer.text
    finally:
        replica.stop()


VICTIMS = ("Frontend_1", "EngineCore")


@pytest.fixture(scope="module")
def doomed(
    tmp_path_factory: pytest.TempPathFactory, tenants_file: Path, tenants_args: tuple[str, ...]
) -> Iterator[dict[str, TestStack]]:
    """A replica for each victim, started side by side (their imports share the cores). The
    engine core's victim is first the module's second replica: behind an Envoy of its own, with
    the first replica's tenants and limits store. The frontend's keeps the same tenants' limits
    in memory."""
    logs = tmp_path_factory.mktemp("doomed")

    def start(victim: str) -> TestStack:
        if victim == "EngineCore":
            return start_replica(logs / f"{victim}.log", True, tenants_args)
        return start_replica(logs / f"{victim}.log", False, ("--tenants-file", str(tenants_file)))

    with ThreadPoolExecutor(len(VICTIMS)) as pool:
        started = list(pool.map(start, VICTIMS))
    try:
        yield dict(zip(VICTIMS, started, strict=True))
    finally:
        for replica in started:
            replica.stop()


@pytest.mark.parametrize("victim", VICTIMS)
def test_a_dead_frontend_or_engine_core_takes_the_replica_down_cleanly(
    doomed: dict[str, TestStack], victim: str
) -> None:
    replica = doomed[victim]
    processes = replica_processes(replica)
    (killed,) = [p for p in processes if victim in " ".join(p.cmdline())]
    killed.kill()
    assert replica.processes[0].wait(timeout=60) == 1
    assert left_running(processes, GONE_SECONDS) == []
    assert replica.service_log is not None
    assert "exited: stopping the replica for a restart" in replica.service_log.read_text()
