"""Adapters across a fleet of two real replicas behind a real Envoy and its picker (a pair of
the module's own, following one adapter root; no adapter at start): a load or unload through
Envoy reaches both replicas and says so, an adapter dropped into the root both follow is
served by each, an adapter's calls go to the replica holding it and spill past the load
bound, and an unload under traffic answers no call with a 5xx. (One
replica's runtime adapters in depth: tests/test_runtime_adapters.py.)"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from llmcompletions.v2 import completions_pb2_grpc

from tests.conftest import MODEL, OPERATOR_KEY, ReplicaPair, pinned_replica
from tests.helpers import CAPITAL_PROMPT, grpc_request
from tests.models import ADAPTER_TARGETS
from tests.test_prefix_routing import HOST_HEADER, Fleet, facade

OPERATOR = {"Authorization": f"Bearer {OPERATOR_KEY}"}


@dataclass
class AdapterFleet(ReplicaPair):
    adapter_root: Path  # the root both replicas follow, as a shared volume


@pytest.fixture(scope="module")
def adapter_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AdapterFleet]:
    logs = tmp_path_factory.mktemp("adapter-fleet")
    root = logs / "root"
    root.mkdir()
    pair = AdapterFleet(
        [
            pinned_replica(
                "adapter-fleet",
                core,
                logs / f"replica-{core}.log",
                [
                    *("--adapter-root", str(root), "--enable-adapter-loading"),
                    *("--operator-api-key", OPERATOR_KEY),
                    *ADAPTER_TARGETS,
                ],
            )
            for core in range(2)
        ],
        root,
    )
    try:
        pair.wait_ready()
        yield pair
    finally:
        pair.stop()


@pytest.fixture(scope="module")
def fleet(adapter_fleet: AdapterFleet) -> Iterator[Fleet]:
    with facade(adapter_fleet.replicas) as running:
        yield running


@pytest.fixture(scope="module")
def staged(adapter_fleet: AdapterFleet, adapter_dirs: dict[str, Path]) -> Iterator[Path]:
    """a1's files, inside the fleet's adapter root but hidden from it."""
    yield shutil.copytree(adapter_dirs["a1"], adapter_fleet.adapter_root / ".staging" / "a1")


def replica_texts(fleet: Fleet, model: str) -> list[str | grpc.StatusCode]:
    """Each replica's own greedy text for `model` (not through Envoy), or its refusal."""
    texts: list[str | grpc.StatusCode] = []
    for replica in fleet.replicas:
        with grpc.insecure_channel(replica.grpc_target) as channel:
            stub = completions_pb2_grpc.CompletionServiceStub(channel)
            request = grpc_request(model=model, prompt=CAPITAL_PROMPT, max_tokens=12)
            try:
                (reply,) = stub.CreateCompletion(request, timeout=60)
                texts.append(reply.choices[0].text)
            except grpc.RpcError as error:
                texts.append(error.code())
    return texts


def post(fleet: Fleet, path: str, **payload: str) -> httpx.Response:
    return httpx.post(f"{fleet.base_url}{path}", json=payload, headers=OPERATOR, timeout=300)


def test_a_load_and_an_unload_through_envoy_reach_every_replica(fleet: Fleet, staged: Path) -> None:
    base = replica_texts(fleet, MODEL)
    loaded = post(fleet, "/v2/load_lora_adapter", lora_name="sql", lora_path=str(staged))
    assert loaded.status_code == 200, loaded.text
    assert loaded.json() == {"lora_name": "sql", "object": "lora_adapter.loaded", "replicas": 2}
    texts = replica_texts(fleet, "sql")
    assert texts[0] == texts[1] and texts[0] != base[0]
    unloaded = post(fleet, "/v2/unload_lora_adapter", lora_name="sql")
    assert unloaded.status_code == 200, unloaded.text
    assert unloaded.json()["replicas"] == 2
    assert replica_texts(fleet, "sql") == [grpc.StatusCode.NOT_FOUND] * 2


def test_an_adapter_dropped_into_the_shared_root_is_served_by_every_replica(
    fleet: Fleet, adapter_fleet: AdapterFleet, staged: Path
) -> None:
    shutil.copytree(staged, adapter_fleet.adapter_root / "dropped")
    texts = replica_texts(fleet, "dropped")
    assert all(isinstance(text, str) for text in texts) and texts[0] == texts[1]


def upstream(fleet: Fleet, model: str, prompt: str, max_tokens: int = 8) -> str:
    """The replica Envoy sent a greedy completion to (its debug header)."""
    payload = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    reply = httpx.post(f"{fleet.base_url}/v2/completions", json=payload, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.headers[HOST_HEADER]


def test_an_adapters_calls_go_where_it_is_resident_and_spill_under_load(
    fleet: Fleet, adapter_fleet: AdapterFleet, staged: Path
) -> None:
    """New prompts of the base model are dealt out over both replicas; an adapter's go to the
    replica that loaded it while it is within the load bound, and past it to the other."""
    hidden = shutil.copytree(staged, adapter_fleet.adapter_root / ".homed")
    hidden.rename(adapter_fleet.adapter_root / "homed")
    holder = upstream(fleet, "homed", "A first question for the adapter:")
    followed = {
        upstream(fleet, "homed", f"Question {index} about {index * 7}:") for index in range(6)
    }
    assert followed == {holder}
    with ThreadPoolExecutor(8) as pool:
        spread = set(
            pool.map(
                lambda index: upstream(fleet, "homed", f"Busy question {index}:", max_tokens=48),
                range(8),
            )
        )
    assert spread == {replica.grpc_target for replica in fleet.replicas}


def wait_until(condition: Callable[[], bool], seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the traffic never got that far"
        time.sleep(0.1)


def test_an_unload_under_traffic_answers_no_call_with_a_5xx(fleet: Fleet, staged: Path) -> None:
    assert post(fleet, "/v2/load_lora_adapter", lora_name="busy", lora_path=str(staged)).is_success
    statuses: list[int] = []
    stop = threading.Event()

    def traffic() -> None:
        with httpx.Client(base_url=fleet.base_url, timeout=120) as client:
            while not stop.is_set():
                payload = {"model": "busy", "prompt": CAPITAL_PROMPT, "max_tokens": 16}
                statuses.append(client.post("/v2/completions", json=payload).status_code)

    senders = [threading.Thread(target=traffic) for _ in range(4)]
    for sender in senders:
        sender.start()
    try:
        wait_until(lambda: statuses.count(200) >= 8)  # traffic on the adapter before it goes
        unloaded = post(fleet, "/v2/unload_lora_adapter", lora_name="busy")
        assert unloaded.status_code == 200 and unloaded.json()["replicas"] == 2
        count = len(statuses)
        wait_until(lambda: len(statuses) >= count + 8)  # and after
    finally:
        stop.set()
        for sender in senders:
            sender.join(120)
    assert set(statuses) <= {200, 404}, statuses
    assert statuses[-1] == 404


def test_base_calls_batched_with_an_adapters_stay_the_base_models(
    fleet: Fleet, adapter_fleet: AdapterFleet, staged: Path
) -> None:
    """No adapter was given at start: on vLLM's CPU build the base model's stand-in adapter is
    built from the model's own weights, and base calls in a batch with adapter calls still get
    the base model's text."""
    shutil.copytree(staged, adapter_fleet.adapter_root / "mixed")
    alone = replica_texts(fleet, MODEL)
    assert replica_texts(fleet, "mixed")[0] != alone[0]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda model: replica_texts(fleet, model), [MODEL, "mixed"] * 4))
    assert all(texts == alone for texts in together[::2])
