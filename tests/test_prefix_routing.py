"""Prefix-cache affinity through a real Envoy in front of the session's fleet of two real
replicas (each on a core of its own), Envoy started as `facade.launch` starts it by default:
requests that share a model and leading prompt land on one replica (REST whole and streamed,
gRPC, text and token ids), whose prefix cache then serves them; instructions every prompt
shares do not pull the documents after them onto one replica; each model is keyed apart;
calls without a prompt carry no key; hostile prompts get answers, with no Lua error and the
picker unharmed; a hot prefix spills to the other replica under load; Envoys sharing one
picker keep each prefix on one replica; a killed replica's prefixes move to the other without
failures, through Envoy's own picker and through a shared one, which drops the replica by its
own health checks. Tests run in file order; the last one kills a replica."""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import math
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import psutil
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import strategies as st
from llmcompletions.v2 import completions_pb2_grpc
from llmcompletions.v2.completions_pb2 import CancelCompletionRequest, CreateCompletionRequest
from xds.data.orca.v3.orca_load_report_pb2 import OrcaLoadReport

from bench.routing import common_prefix_length
from facade.balancing import PATH_HEADER, PrefixAffinity
from facade.picker.policy import PromptPath
from facade.picker.protocol import DESTINATION_HEADER
from tests.certificates import CertificateAuthority
from tests.conftest import MODEL, FleetReplicas
from tests.helpers import body, grpc_request
from tests.metrics import engine_block_tokens, sample
from tests.processes import (
    TestStack,
    envoy_counter,
    free_port,
    healthy_upstreams,
    lua_errors,
    shared_picker,
    stop_helpers,
)
from tests.test_fuzz import fuzz_grpc, fuzz_rest, models, prompts
from tests.test_grpc_tooling import grpcurl

CREATE_COMPLETION_METHOD = "llmcompletions.v2.CompletionService/CreateCompletion"

# An adapter's name the fleet does not serve: routed and keyed like any model, answered 404.
UNSERVED_MODEL = "sql"
KEY_HEADER = "x-prefix-key"
HOST_HEADER = "x-upstream-host"
RING_SETTLE_SECONDS = 2.0


@dataclass
class Fleet:
    replicas: list[TestStack]
    envoy: subprocess.Popen[bytes]
    base_url: str
    grpc_target: str
    admin_url: str

    def replica_at(self, host: str) -> TestStack:
        (replica,) = [r for r in self.replicas if r.grpc_target == host]
        return replica

    def healthy(self) -> set[str]:
        return healthy_upstreams(self.admin_url, "completion_service_prefix")


@pytest.fixture(scope="module")
def fleet(fleet_replicas: FleetReplicas) -> Iterator[Fleet]:
    """The session's two replicas behind an Envoy of this module's."""
    with facade(fleet_replicas.replicas) as running:
        yield running


@contextlib.contextmanager
def facade(replicas: list[TestStack], *launch_args: str) -> Iterator[Fleet]:
    """Envoy in front of the replicas, as facade.launch starts it by default (or with
    `launch_args`), once it sees both healthy."""
    http_port, admin_port = free_port(), free_port()
    command = [sys.executable, "-m", "facade.launch", "--debug-headers", *launch_args]
    command += ["--http-port", str(http_port), "--admin-port", str(admin_port)]
    for replica in replicas:
        command += ["--upstream", replica.grpc_target]
    envoy = subprocess.Popen(command)
    running = Fleet(
        replicas,
        envoy,
        f"http://127.0.0.1:{http_port}",
        f"127.0.0.1:{http_port}",
        f"http://127.0.0.1:{admin_port}",
    )
    try:
        deadline = time.monotonic() + 60
        while running.healthy() != {
            r.grpc_target for r in replicas if r.processes[0].poll() is None
        }:
            assert time.monotonic() < deadline, "Envoy never saw the replicas healthy"
            time.sleep(0.5)
        # Envoy's worker threads receive the new host set (and rebuild the hash ring) shortly
        # after the admin interface shows it; the picker reads it every 250 ms.
        time.sleep(RING_SETTLE_SECONDS)
        yield running
    finally:
        stop_helpers([envoy])


def wait_gone(process: psutil.Process, timeout: float = 60) -> None:
    """Until the process has exited (a zombie waiting for its parent to reap it counts)."""
    deadline = time.monotonic() + timeout
    with contextlib.suppress(psutil.NoSuchProcess):
        while process.status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, f"still running: {where_it_waits(process)}"
            time.sleep(0.1)


def where_it_waits(process: psutil.Process) -> str:
    """A process that should have exited: what it is, where the kernel has it waiting, and
    its children (once seen on a loaded host: a picker's supervisor still there after 30 s)."""
    wchan = Path(f"/proc/{process.pid}/wchan")
    waiting = wchan.read_text() if wchan.exists() else "?"
    children = [(c.pid, c.status(), c.cmdline()[-4:]) for c in process.children()]
    return f"{process.pid} {process.cmdline()[:4]} {process.status()} in {waiting}; {children}"


def is_picker(process: psutil.Process) -> bool:
    """A running picker (one killed is a zombie until its supervisor reaps it)."""
    try:
        return "facade.picker.server" in process.cmdline()
    except psutil.Error:
        return False


def picker_of(envoy: subprocess.Popen[bytes]) -> tuple[psutil.Process, psutil.Process]:
    """The replica picker facade.launch started beside Envoy: (its supervisor, the picker)."""
    (supervisor,) = [
        child
        for child in psutil.Process(envoy.pid).children()
        if "facade.picker.supervisor" in child.cmdline()
    ]
    deadline = time.monotonic() + 30
    while True:
        pickers = [child for child in supervisor.children() if is_picker(child)]
        if pickers:
            return supervisor, pickers[0]
        assert time.monotonic() < deadline, "the supervisor started no picker"
        time.sleep(0.2)


# Words of one token each: a prefix longer than the key in bytes stays short in tokens, and
# prefilling the prompts is where these tests spend their time.
LONG_WORDS = ("information", "development", "international", "responsibility", "communication")


def shared_prefix(label: str, min_words: int = 0) -> str:
    """A leading part longer than the key's, new to every replica's cache."""
    text = f"[{label} {uuid.uuid4()}]"
    words = itertools.cycle(LONG_WORDS)
    count = 0
    while len(text.encode()) <= PrefixAffinity().chars or count < min_words:
        text += f" {next(words)}"
        count += 1
    return text


def rest_call(
    fleet: Fleet, headers: dict[str, str] | None = None, **fields: Any
) -> tuple[str, dict[str, Any]]:
    """(the replica that served it, the reply)."""
    reply = httpx.post(
        f"{fleet.base_url}/v2/completions", json=body(**fields), headers=headers, timeout=120
    )
    assert reply.status_code == 200, reply.text[:300]
    return reply.headers[HOST_HEADER], reply.json()


def rest_stream_host(fleet: Fleet, **fields: Any) -> str:
    with httpx.stream(
        "POST", f"{fleet.base_url}/v2/completions", json=body(stream=True, **fields), timeout=120
    ) as reply:
        assert reply.status_code == 200
        assert [line for line in reply.iter_lines() if line][-1] == "data: [DONE]"
        return reply.headers[HOST_HEADER]


def grpc_host(fleet: Fleet, metadata: tuple[tuple[str, str], ...] = (), **fields: Any) -> str:
    with grpc.insecure_channel(fleet.grpc_target) as channel:
        call = completions_pb2_grpc.CompletionServiceStub(channel).CreateCompletion(
            grpc_request(**fields), timeout=120, metadata=metadata
        )
        list(call)
        return dict(call.initial_metadata())[HOST_HEADER]


def test_requests_sharing_a_prefix_land_on_one_replica_on_both_surfaces(fleet: Fleet) -> None:
    homes: list[str] = []
    for label in range(8):
        prefix = shared_prefix(f"doc {label}")
        hosts = {
            rest_call(fleet, prompt=f"{prefix} Question A?", max_tokens=2)[0],
            rest_stream_host(fleet, prompt=f"{prefix} Question B?", max_tokens=2),
            grpc_host(fleet, prompt=f"{prefix} Question C?", max_tokens=2),
        }
        assert len(hosts) == 1, f"prefix {label} went to {hosts}"
        homes.extend(hosts)
    # The picker deals new prefixes out evenly (the first test: no key seen before).
    assert sorted(homes.count(r.grpc_target) for r in fleet.replicas) == [4, 4], homes


def chat_host(fleet: Fleet, messages: list[dict[str, Any]]) -> str:
    reply = httpx.post(
        f"{fleet.base_url}/v2/chat/completions",
        json={"model": MODEL, "messages": messages, "temperature": 0, "max_completion_tokens": 2},
        timeout=120,
    )
    assert reply.status_code == 200, reply.text[:300]
    return reply.headers[HOST_HEADER]


def test_a_conversations_turns_stay_on_one_replica(fleet: Fleet) -> None:
    homes: list[str] = []
    for label in range(6):
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": shared_prefix(f"conversation {label}")}
        ]
        hosts = set()
        for turn in range(3):
            hosts.add(chat_host(fleet, messages))
            messages += [
                {"role": "assistant", "content": f"Answer {turn}."},
                {"role": "user", "content": f"And then {turn}?"},
            ]
        assert len(hosts) == 1, f"conversation {label} went to {hosts}"
        homes.extend(hosts)
    assert len(set(homes)) == 2, homes  # the conversations themselves spread over both


def test_shared_instructions_do_not_pull_the_documents_after_them_together(fleet: Fleet) -> None:
    # Instructions longer than the key (Envoy's hashing alone would key every prompt alike),
    # then a document of each prompt's own, more than twice as long.
    instructions = shared_prefix("instructions")
    documents = [shared_prefix(f"document {d}", min_words=200) for d in range(4)]
    served: dict[int, set[str]] = {d: set() for d in range(4)}
    for question in ("What is it about?", "Who wrote it?"):
        for d, document in enumerate(documents):
            prompt = f"{instructions}\n{document}\n{question}"
            # A path a caller sends is replaced by the prompt's own.
            host, _ = rest_call(
                fleet, prompt=prompt, max_tokens=1, headers={PATH_HEADER: "1 1 forged"}
            )
            served[d].add(host)
    assert all(len(hosts) == 1 for hosts in served.values()), served
    homes = [hosts.pop() for hosts in served.values()]
    # Dealt out evenly (the first test left each replica home to as many prefixes).
    assert sorted(homes.count(r.grpc_target) for r in fleet.replicas) == [2, 2], homes


def test_the_replica_picked_serves_and_the_other_is_next_for_retries(fleet: Fleet) -> None:
    reply = httpx.post(
        f"{fleet.base_url}/v2/completions",
        json=body(prompt=shared_prefix("picked"), max_tokens=1),
        timeout=120,
    )
    assert reply.status_code == 200
    picked = reply.headers["x-replica-picked"].split(",")
    assert sorted(picked) == sorted(r.grpc_target for r in fleet.replicas)
    assert reply.headers[HOST_HEADER] == picked[0]


def prompt_tokens(fleet: Fleet, prompt: str) -> list[int]:
    reply = httpx.post(f"{fleet.base_url}/v2/tokenize", json=body(prompt=prompt), timeout=30)
    assert reply.status_code == 200, reply.text
    return reply.json()["tokens"]


def metrics_url(replica: TestStack) -> str:
    port = replica.service_args[replica.service_args.index("--metrics-port") + 1]
    return f"http://127.0.0.1:{port}/metrics"


def test_the_keyed_replica_serves_the_shared_prefix_from_its_cache(fleet: Fleet) -> None:
    prefix = shared_prefix("cache", min_words=300)  # a few of the engine's blocks
    first_prompt, again_prompt = f"{prefix} First?", f"{prefix} Second, longer?"
    first_host, first = rest_call(fleet, prompt=first_prompt, max_tokens=1)
    again_host, again = rest_call(fleet, prompt=again_prompt, max_tokens=1)
    assert again_host == first_host
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # Every whole block of the part the two prompts share came from the cache.
    shared = common_prefix_length(
        prompt_tokens(fleet, first_prompt), prompt_tokens(fleet, again_prompt)
    )
    block = engine_block_tokens(metrics_url(fleet.replica_at(first_host)))
    assert shared > 2 * block
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == shared // block * block


def test_token_id_prompts_are_keyed_by_their_leading_ids(fleet: Fleet) -> None:
    for start in range(100, 104):
        shared = list(range(start, start + PrefixAffinity().tokens + 20))
        hosts = {
            rest_call(fleet, prompt=[*shared, 7, 8], max_tokens=1)[0],
            grpc_host(fleet, prompt=[*shared, 9], max_tokens=1),
            rest_call(fleet, prompt=[[*shared, 10], [11]], max_tokens=1)[0],
        }
        assert len(hosts) == 1, hosts


def key_of(fleet: Fleet, status: int = 200, **fields: Any) -> str:
    """The routing key Envoy gave a completion (its --debug-headers show it)."""
    reply = httpx.post(f"{fleet.base_url}/v2/completions", json=body(**fields), timeout=120)
    assert reply.status_code == status, reply.text[:300]
    return reply.headers[KEY_HEADER]


def path_of(fleet: Fleet, prompt: str | list[int]) -> PromptPath:
    reply = httpx.post(
        f"{fleet.base_url}/v2/completions", json=body(prompt=prompt, max_tokens=1), timeout=120
    )
    assert reply.status_code == 200, reply.text[:300]
    path = PromptPath.parse(reply.headers[PATH_HEADER])
    assert path is not None, reply.headers[PATH_HEADER]
    return path


@pytest.mark.parametrize(
    ("first", "second", "base", "shared_levels"),
    [
        # 500 bytes alike: the keys of 64, 96, 128, 192, 256 and 384 bytes.
        ("a" * 500 + "b" * 300, "a" * 500 + "c" * 300, 64, 6),
        # 40 ids alike: the keys of 16, 24 and 32 ids.
        (list(range(1, 61)), [*range(1, 41), *range(100, 120)], 16, 3),
    ],
)
def test_the_path_keys_a_prompt_at_the_depths_the_picker_reads(
    fleet: Fleet, first: str | list[int], second: str | list[int], base: int, shared_levels: int
) -> None:
    one, other = path_of(fleet, first), path_of(fleet, second)
    assert (one.base, one.length) == (base, len(first))
    # One key per level until a level covers the whole prompt.
    assert one.depth(len(one.keys) - 2) < one.length == one.depth(len(one.keys) - 1)
    alike = common_prefix_length(one.keys, other.keys)
    assert alike == shared_levels, (one, other)


def test_a_batch_of_token_id_prompts_is_keyed_by_its_first_prompts_lead(fleet: Fleet) -> None:
    # Envoy sees a batch's ids as one list; its path stops at the key's length, so that the
    # prompts after the first do not count as part of it.
    first = list(range(1, 301))
    batch = path_of(fleet, [first, list(range(500, 800))])
    alone = path_of(fleet, first)
    key_ids = PrefixAffinity().tokens
    assert batch.length == key_ids and alone.length == len(first)
    assert batch.keys == alone.keys[: len(batch.keys)]


def test_each_model_of_a_pool_is_keyed_apart(fleet: Fleet) -> None:
    """The key covers the model: an adapter's prompts are kept apart from the base model's
    (whose cache blocks they cannot use). Keying happens before any replica sees the call, so
    a name these replicas do not serve is keyed the same way, then answered 404."""
    prompt = shared_prefix("adapters")
    base = {key_of(fleet, prompt=prompt, max_tokens=1) for _ in range(2)}
    adapter = {
        key_of(fleet, 404, model=UNSERVED_MODEL, prompt=prompt, max_tokens=1) for _ in range(2)
    }
    assert len(base) == len(adapter) == 1 and base != adapter


def test_calls_without_a_prompt_carry_no_key(fleet: Fleet) -> None:
    listed = httpx.get(f"{fleet.base_url}/v2/models", timeout=30)
    assert listed.status_code == 200
    assert listed.headers.get(KEY_HEADER, "-") in ("", "-")
    long_name = httpx.post(
        f"{fleet.base_url}/v2/completions",
        json={"model": "m" * 100_000, "prompt": "Hi", "max_tokens": 1},
        timeout=30,
    )
    assert long_name.status_code == 404  # answered by a replica, not refused for its headers


# Token ids that JSON cannot carry (or that no vocabulary has), sent over gRPC.
UNREPRESENTABLE_IDS = ([math.nan], [math.inf, 1.0], [-math.inf], [2.0**40], [-1.0], [0.5])
routing_bodies = st.fixed_dictionaries(
    {"model": models | st.just(UNSERVED_MODEL), "prompt": prompts, "max_tokens": st.just(1)}
)


def test_hostile_prompts_through_the_routing_path_get_answers(fleet: Fleet) -> None:
    # The routing filter and the picker read every completion's model and prompt here.
    supervisor, picker = picker_of(fleet.envoy)
    with httpx.Client(base_url=fleet.base_url, timeout=120) as client:
        fuzz_rest(client, routing_bodies)
    with grpc.insecure_channel(fleet.grpc_target) as channel:
        stub = completions_pb2_grpc.CompletionServiceStub(channel)
        fuzz_grpc(stub, routing_bodies)
        for ids in UNREPRESENTABLE_IDS:
            prompt = struct_pb2.Value()
            prompt.list_value.values.extend(struct_pb2.Value(number_value=i) for i in ids)
            request = CreateCompletionRequest(model=MODEL, prompt=prompt, max_tokens=1)
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.CreateCompletion(request, timeout=60))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ids
    # Nothing crashed or restarted, no Lua filter failed (one that fails lets the request pass
    # unkeyed), and the picker still picks.
    assert fleet.envoy.poll() is None
    assert lua_errors(fleet.admin_url) == 0
    assert is_picker(picker) and picker_of(fleet.envoy) == (supervisor, picker)
    reply = httpx.post(
        f"{fleet.base_url}/v2/completions",
        json=body(prompt=shared_prefix("after hostile prompts"), max_tokens=1),
        timeout=120,
    )
    assert reply.status_code == 200, reply.text[:300]
    replicas = sorted(r.grpc_target for r in fleet.replicas)
    assert sorted(reply.headers["x-replica-picked"].split(",")) == replicas


def test_a_hot_prefix_spills_to_the_other_replica_under_load(fleet: Fleet) -> None:
    prefix = shared_prefix("hot")
    with ThreadPoolExecutor(8) as pool:
        hosts = list(
            pool.map(
                lambda i: rest_stream_host(
                    fleet, prompt=f"{prefix} Caller {i}:", max_tokens=48, ignore_eos=True
                ),
                range(8),
            )
        )
    counts = {host: hosts.count(host) for host in set(hosts)}
    # Once both replicas hold the prefix, its requests go to the less loaded of the two.
    assert len(counts) == 2, f"no spill: {counts}"


def test_without_its_picker_envoy_still_keeps_a_prefix_on_one_replica(fleet: Fleet) -> None:
    targets = [replica.grpc_target for replica in fleet.replicas]
    with facade(fleet.replicas) as other:
        supervisor, picker = picker_of(other.envoy)
        supervisor.kill()  # the picker goes with it, and nothing restarts it
        wait_gone(supervisor)
        wait_gone(picker)
        prefix = shared_prefix("no picker")
        # Each call also names a replica itself in x-gateway-destination-endpoint, alternately
        # both: a caller
        # cannot pin a replica (Envoy drops the header), so the key alone decides.
        hosts = {
            rest_call(
                other,
                prompt=f"{prefix} Question {i}?",
                max_tokens=1,
                headers={DESTINATION_HEADER: targets[i % 2]},
            )[0]
            for i in range(4)
        }
        for i in range(2):
            hosts.add(
                grpc_host(
                    other,
                    prompt=f"{prefix} Question {5 + i}?",
                    max_tokens=1,
                    metadata=((DESTINATION_HEADER, targets[i]),),
                )
            )
        assert len(hosts) == 1, hosts


def picked_replicas(fleet: Fleet, prompt: str) -> tuple[str, list[str]]:
    """(the replica that served a keyed call, the replicas the picker named for it)."""
    reply = httpx.post(
        f"{fleet.base_url}/v2/completions", json=body(prompt=prompt, max_tokens=1), timeout=120
    )
    assert reply.status_code == 200, reply.text[:300]
    picked = reply.headers.get("x-replica-picked", "")
    return reply.headers[HOST_HEADER], picked.split(",") if picked else []


def wait_for_picks(fleet: Fleet, timeout: float = 30) -> None:
    """Until the picker names both replicas (it checks their health first)."""
    deadline = time.monotonic() + timeout
    while len(picked_replicas(fleet, shared_prefix("first pick"))[1]) < 2:
        assert time.monotonic() < deadline, "the picker never named both replicas"
        time.sleep(0.5)


def test_envoys_sharing_one_picker_keep_each_prefix_on_one_replica(fleet: Fleet) -> None:
    port = free_port()
    targets = [replica.grpc_target for replica in fleet.replicas]
    with (
        shared_picker(port, targets) as picker,
        facade(fleet.replicas, "--picker", f"127.0.0.1:{port}") as first,
        facade(fleet.replicas, "--picker", f"127.0.0.1:{port}") as second,
    ):
        fronts = [first, second]
        wait_for_picks(first)
        prefixes = [shared_prefix(f"shared picker {i}") for i in range(3)]
        served: dict[int, list[str]] = {i: [] for i in range(3)}
        # Each Envoy meets the prefixes in another order: two pickers of their own would deal
        # them out apart (the first prefix to a replica through one Envoy, to the other
        # through the other), one shared picker deals each once.
        for turn in range(2):
            for i, prefix in enumerate(prefixes):
                host, picked = picked_replicas(fronts[(i + turn) % 2], f"{prefix} Turn {turn}?")
                assert picked and picked[0] == host, (host, picked)
                served[i].append(host)
        assert all(len(set(hosts)) == 1 for hosts in served.values()), served
        assert {hosts[0] for hosts in served.values()} == set(targets), served
        assert all(lua_errors(front.admin_url) == 0 for front in fronts)

        picker.kill()  # both Envoys fail open to hashing the key, which they hash alike
        picker.wait(timeout=30)
        prefix = shared_prefix("shared picker gone")
        hosts = {
            rest_call(fronts[i % 2], prompt=f"{prefix} Q{i}?", max_tokens=1)[0] for i in range(4)
        }
        assert len(hosts) == 1, hosts


def picks_made(fleet: Fleet, calls: int = 6) -> int:
    """How many of `calls` keyed calls the picker named replicas for (all are answered)."""
    return sum(bool(picked_replicas(fleet, shared_prefix("tls"))[1]) for _ in range(calls))


def picker_stat(fleet: Fleet, name: str) -> int:
    """A counter of Envoy's cluster of the picker."""
    return envoy_counter(fleet.admin_url, f"cluster.replica_picker.{name}")


def test_envoy_reaches_a_shared_picker_over_mutual_tls(fleet: Fleet, tmp_path: Path) -> None:
    authority = CertificateAuthority(tmp_path)
    server, client = authority.server("picker", by_ip=False), authority.client()  # localhost
    port = free_port()
    serve_tls = [
        *("--tls-cert-file", str(server.cert_file), "--tls-key-file", str(server.key_file)),
        *("--tls-client-ca-file", str(authority.cert_file)),
    ]
    trust = ["--picker-ca-file", str(authority.cert_file)]
    present = [
        "--picker-cert-file",
        str(client.cert_file),
        "--picker-key-file",
        str(client.key_file),
    ]
    targets = [replica.grpc_target for replica in fleet.replicas]
    with shared_picker(port, targets, tmp_path / "picker.log", serve_tls):
        with facade(fleet.replicas, "--picker", f"localhost:{port}", *trust, *present) as front:
            wait_for_picks(front)
            assert picks_made(front) == 6
        # Envoy fails open to hashing, and the picker is asked nothing, when Envoy presents no
        # certificate, or when the picker's certificate does not name the address Envoy dials.
        with facade(fleet.replicas, "--picker", f"localhost:{port}", *trust) as front:
            assert picks_made(front) == 0
            assert picker_stat(front, "upstream_cx_destroy_remote") > 0  # the picker refused
        with facade(fleet.replicas, "--picker", f"127.0.0.1:{port}", *trust, *present) as front:
            assert picks_made(front) == 0
            assert picker_stat(front, "ssl.fail_verify_san") > 0  # Envoy refused


def test_the_picker_leaves_with_envoy(fleet: Fleet) -> None:
    with facade(fleet.replicas) as other:
        supervisor, picker = picker_of(other.envoy)
        other.envoy.kill()
        wait_gone(supervisor)
        wait_gone(picker)


def test_a_picker_that_dies_is_restarted_and_picks_again(fleet: Fleet) -> None:
    with facade(fleet.replicas) as other:
        supervisor, picker = picker_of(other.envoy)
        picker.kill()
        wait_gone(picker)
        same_supervisor, restarted = picker_of(other.envoy)
        assert same_supervisor.pid == supervisor.pid
        assert restarted.pid != picker.pid
        replicas = sorted(r.grpc_target for r in fleet.replicas)
        deadline = time.monotonic() + 30
        while True:  # until the new picker answers (it reads the replicas' health first)
            reply = httpx.post(
                f"{other.base_url}/v2/completions",
                json=body(prompt=shared_prefix("restarted"), max_tokens=1),
                timeout=120,
            )
            assert reply.status_code == 200, reply.text[:300]
            picked = reply.headers.get("x-replica-picked", "")
            if sorted(picked.split(",")) == replicas:
                break
            assert time.monotonic() < deadline, f"no pick after the restart: {picked!r}"
            time.sleep(0.5)
        assert reply.headers[HOST_HEADER] == picked.split(",")[0]


def test_envoy_and_the_picker_use_only_the_endpoint_picker_protocols_names(fleet: Fleet) -> None:
    dump = httpx.get(f"{fleet.admin_url}/config_dump", timeout=10).text
    for standard in (
        "x-gateway-destination-endpoint",
        "envoy.lb",
        "envoy.lb.subset_hint",
        "x-gateway-destination-endpoint-served",
    ):
        assert standard in dump, standard
    assert '"x-replica"' not in dump
    # A pick travels in those names: the debug header echoes the request's destination header.
    host, picked = picked_replicas(fleet, shared_prefix("standard names"))
    assert picked and picked[0] == host


def ext_proc_answer(
    target: str, subset: list[str] | None, path: str = "64 50 k"
) -> ext_proc.ProcessingResponse:
    """What a picker answers a gateway's request headers (with a subset hint, if given)."""
    message = ext_proc.ProcessingRequest(
        request_headers=ext_proc.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=PATH_HEADER, raw_value=path.encode())]
            )
        )
    )
    if subset is not None:
        message.metadata_context.filter_metadata["envoy.lb.subset_hint"].update(
            {"x-gateway-destination-endpoint-subset": subset}
        )
    with grpc.insecure_channel(target) as channel:
        stub = ext_proc_grpc.ExternalProcessorStub(channel)
        metadata = (("x-picker-cluster", "completion_service_prefix"),)
        (answer,) = list(stub.Process(iter([message]), timeout=10, metadata=metadata))
        return answer


def health(target: str, service: str) -> int:
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def test_a_picker_serves_its_health_and_answers_a_subset_hint(fleet: Fleet) -> None:
    port = free_port()
    targets = sorted(replica.grpc_target for replica in fleet.replicas)
    picker = f"127.0.0.1:{port}"
    with shared_picker(port, targets):
        assert health(picker, "liveness") == health_pb2.HealthCheckResponse.SERVING
        deadline = time.monotonic() + 30
        while health(picker, "readiness") != health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline, "the picker never became ready"
            time.sleep(0.2)
        processor = "envoy.service.ext_proc.v3.ExternalProcessor"
        assert health(picker, processor) == health_pb2.HealthCheckResponse.SERVING
        while len(ext_proc_answer(picker, None).dynamic_metadata.fields) == 0:
            assert time.monotonic() < deadline, "the picker never saw the replicas healthy"
            time.sleep(0.5)
        for i, allowed in enumerate(targets):
            for key in range(3):
                answer = ext_proc_answer(picker, [allowed], f"64 50 subset-{i}-{key}")
                lb = answer.dynamic_metadata.fields["envoy.lb"].struct_value
                assert lb.fields[DESTINATION_HEADER].string_value == allowed
        refused = ext_proc_answer(picker, ["127.0.0.1:1"])
        assert refused.immediate_response.status.code == 503


def grpcurl_trailers(target: str, request: dict[str, Any]) -> dict[str, str]:
    """The trailers a completion's reply ends with, as grpcurl (a plain gRPC client) shows
    them. gRPC's own Python client keeps `endpoint-load-metrics-bin` to itself: its core
    parses ORCA reports for load balancing."""
    done = grpcurl(target, CREATE_COMPLETION_METHOD, options=("-v", "-d", json.dumps(request)))
    shown = done.stdout + done.stderr
    assert "Response trailers received:" in shown, shown
    trailers = shown.split("Response trailers received:", 1)[1]
    return dict(
        line.split(": ", 1) for line in trailers.splitlines() if ": " in line and line[0] != " "
    )


def load_report_of(trailers: dict[str, str]) -> OrcaLoadReport:
    return OrcaLoadReport.FromString(base64.b64decode(trailers["endpoint-load-metrics-bin"]))


def test_every_reply_carries_the_replicas_load_report(fleet: Fleet) -> None:
    replica = fleet.replicas[0]
    for target in (replica.grpc_target, fleet.grpc_target):  # the replica, and through Envoy
        report = load_report_of(grpcurl_trailers(target, body(prompt="Hi", max_tokens=2)))
        assert set(report.named_metrics) >= {
            "num_requests_waiting",
            "num_requests_running",
            "kv_cache_usage_perc",
            "max_num_queued_reqs",
        }
        assert report.named_metrics["max_num_queued_reqs"] >= 128  # 8 batches of the engine
        assert 0 <= report.utilization["kv_cache"] <= 1
        failed = grpcurl_trailers(target, body(model="nobody", prompt="Hi"))
        assert "endpoint-load-metrics-bin" in failed  # an error ends with one too
    asked = httpx.post(
        f"{fleet.base_url}/v2/completions",
        json=body(prompt="Hi", max_tokens=2),
        headers={"endpoint-load-metrics-format": "text"},
        timeout=60,
    )
    assert asked.status_code == 200
    assert asked.headers["endpoint-load-metrics"].startswith("TEXT application_utilization=")
    assert "named_metrics.num_requests_waiting=" in asked.headers["endpoint-load-metrics"]


def direct_streams(replica: TestStack, count: int, stop: threading.Event) -> list[threading.Thread]:
    """`count` long completions sent straight to a replica's gRPC port (no Envoy, no picker),
    running until `stop` is set."""

    def run() -> None:
        with grpc.insecure_channel(replica.grpc_target) as channel:
            stub = completions_pb2_grpc.CompletionServiceStub(channel)
            call = stub.CreateCompletion(
                grpc_request(prompt="Count:", max_tokens=480, ignore_eos=True, stream=True),
                timeout=300,
            )
            with contextlib.suppress(grpc.RpcError):  # cancelled below
                for _ in call:
                    if stop.is_set():
                        call.cancel()

    threads = [threading.Thread(target=run) for _ in range(count)]
    for thread in threads:
        thread.start()
    return threads


def test_a_replica_busy_with_other_callers_gets_fewer_new_requests(fleet: Fleet) -> None:
    """Its load reports tell the picker of the requests it did not send there."""
    busy, idle = fleet.replicas
    stop = threading.Event()
    streams = direct_streams(busy, 6, stop)
    try:
        deadline = time.monotonic() + 60
        while sample(metrics_url(busy), "llmcompletions_engine_unfinished_requests") < 6:
            assert time.monotonic() < deadline, "the direct streams never reached the engine"
            time.sleep(0.2)
        # New prefixes, one after another: without reports they are dealt out evenly (each
        # replica is home to as many); with them, the busy one is past the load bound.
        hosts = [
            rest_call(fleet, prompt=f"{shared_prefix(f'busy {i}')} Q?", max_tokens=1)[0]
            for i in range(10)
        ]
    finally:
        stop.set()
        for stream in streams:
            stream.join(timeout=60)
    assert hosts.count(busy.grpc_target) <= 2, hosts
    assert hosts.count(idle.grpc_target) >= 8, hosts


def test_a_stream_is_cancelled_by_its_id_through_another_envoy(fleet: Fleet) -> None:
    with facade(fleet.replicas) as second:
        request_id = f"fleet-cancel-{uuid.uuid4().hex}"
        events: list[str] = []
        with httpx.stream(
            "POST",
            f"{fleet.base_url}/v2/completions",
            json=body(prompt=shared_prefix("cancel"), max_tokens=380, ignore_eos=True, stream=True),
            headers={"x-request-id": request_id},
            timeout=120,
        ) as reply:
            assert reply.status_code == 200
            host = reply.headers[HOST_HEADER]
            for line in reply.iter_lines():
                if not line:
                    continue
                events.append(line.removeprefix("data: "))
                if len(events) == 3:
                    # The second Envoy's picker never saw the request: the cancel asks the
                    # replicas in turn until the one holding it answers.
                    answer = httpx.post(
                        f"{second.base_url}/v2/completions/{request_id}/cancel", timeout=30
                    )
                    assert answer.status_code == 200, answer.text
                    assert answer.json()["cancelled"] == 1
        assert json.loads(events[-1])["error"]["status_code"] == 499
        assert len(events) < 100
        holder = metrics_url(fleet.replica_at(host))
        deadline = time.monotonic() + 5
        while sample(holder, "llmcompletions_engine_unfinished_requests") != 0:
            assert time.monotonic() < deadline, "the engine still runs the cancelled request"
            time.sleep(0.1)
        # Through the first Envoy, whose picker knows where each request is, and over gRPC.
        with grpc.insecure_channel(fleet.grpc_target) as channel:
            stub = completions_pb2_grpc.CompletionServiceStub(channel)
            with pytest.raises(grpc.RpcError) as raised:
                stub.CancelCompletion(CancelCompletionRequest(request_id=request_id), timeout=30)
            assert raised.value.code() == grpc.StatusCode.NOT_FOUND  # it ended
        unknown = httpx.post(f"{second.base_url}/v2/completions/nobody-knows/cancel", timeout=30)
        assert unknown.status_code == 404  # every replica was asked


def prefix_served_by(fleet: Fleet, host: str, label: str, tries: int = 12) -> str:
    """A new prefix that `fleet` sends to the replica at `host` (one prefix in two goes there)."""
    for attempt in range(tries):
        prefix = shared_prefix(f"{label} {attempt}")
        if rest_call(fleet, prompt=f"{prefix} Before?", max_tokens=1)[0] == host:
            return prefix
    raise AssertionError(f"{tries} new prefixes and none went to {host}")


def test_a_killed_replicas_prefixes_move_to_the_other_without_failures(
    fleet: Fleet, tmp_path: Path
) -> None:
    """Through Envoy with its own picker, which follows Envoy's health checks, and through an
    Envoy asking a shared picker, which checks the replicas' health itself."""
    port = free_port()
    targets = [replica.grpc_target for replica in fleet.replicas]
    with (
        shared_picker(port, targets, tmp_path / "picker.log"),
        facade(fleet.replicas, "--picker", f"127.0.0.1:{port}") as shared,
    ):
        wait_for_picks(shared)
        prefix = shared_prefix("moved, shared picker")
        host, picked = picked_replicas(shared, f"{prefix} Before?")
        assert picked[0] == host, (host, picked)
        victim = fleet.replica_at(host)
        (survivor,) = [r.grpc_target for r in fleet.replicas if r is not victim]
        own_prefix = prefix_served_by(fleet, host, "moved, own picker")

        victim.processes[0].send_signal(signal.SIGKILL)
        victim.processes[0].wait(timeout=30)
        # Until the shared picker's checks find the replica gone it still names it first, and
        # Envoy's retry takes the next it names: no call fails meanwhile.
        deadline = time.monotonic() + 20
        while True:
            host, picked = picked_replicas(shared, f"{prefix} After?")
            assert host == survivor, (host, picked)
            if picked == [survivor]:
                break
            assert time.monotonic() < deadline, f"the shared picker still names {picked}"
            time.sleep(0.5)
        after = [picked_replicas(shared, f"{prefix} After {i}?") for i in range(3)]
        assert after == [(survivor, [survivor])] * 3
        assert "not healthy" in (tmp_path / "picker.log").read_text()

    time.sleep(1)
    after_own = [
        rest_call(fleet, prompt=f"{own_prefix} After {i}?", max_tokens=1)[0] for i in range(5)
    ]
    assert after_own == [survivor] * 5
