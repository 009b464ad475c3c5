"""Two base models behind one Envoy, each a pool of one replica: the session's default stack
(pool `smollm2-135m-instruct`) and its adapter stack (pool `smollm2-lora`, with the adapters
`a1` and `a2`), behind `facade.launch --pool ...`. Each call reaches the pool serving its
`model` on REST and gRPC, with nothing but the request itself to go by; the listing, the 404
and grpcurl see every pool's models. (The launcher waiting for pools that are still loading:
tests/unit/test_pool_discovery.py.)"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health, health_pb2_grpc
from llmcompletions.v2 import completions_pb2_grpc
from llmcompletions.v2.completions_pb2 import (
    GetModelInfoRequest,
    ListModelsRequest,
    ListModelsResponse,
    Model,
)

from plumbing.headers import ENDPOINT_MODELS_HEADER
from tests.conftest import (
    API_KEY,
    AUTH_HEADERS,
    GRPC_AUTH,
    LORA_MODEL,
    MODEL,
    OPERATOR_KEY,
    adapter_root_of,
)
from tests.helpers import CAPITAL_PROMPT, grpc_request
from tests.metrics import scrape
from tests.processes import TestStack, free_port, lua_errors, stop_helpers
from tests.test_grpc_tooling import grpcurl

ALPHA, BETA = MODEL, LORA_MODEL
ADAPTER = "a1"
OWNER = {ALPHA: ALPHA, BETA: BETA, ADAPTER: BETA, "a2": BETA}
GREEDY = {"prompt": CAPITAL_PROMPT, "max_tokens": 6, "temperature": 0}
# Adapters the adapter stack gains while it serves: named so, they are routed to its pool.
LATER_ADAPTERS = "pool-later-"
STOPPED_POOL = "gamma"
# The default stack needs a key: every call carries it (the adapter stack ignores it).
LAUNCH_ENV = {**os.environ, "API_KEY": API_KEY}


@dataclass
class Endpoint:
    pools: dict[str, TestStack]
    envoy: subprocess.Popen[bytes]
    http_port: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    def served(self, pool: str, method: str) -> float:
        """The calls of `method` that the pool's replica has answered, whatever their status."""
        return sum(
            value
            for (name, labels), value in scrape(self.pools[pool].metrics_url).items()
            if name == "llmcompletions_requests_total" and ("method", method) in labels
        )


def listed_names(base_url: str) -> set[str]:
    try:
        reply = httpx.get(f"{base_url}/v2/models", headers=AUTH_HEADERS, timeout=5)
    except httpx.HTTPError:
        return set()
    return {model["id"] for model in reply.json()["data"]} if reply.status_code == 200 else set()


@pytest.fixture(scope="module")
def endpoint(stack: TestStack, lora_stack: TestStack) -> Iterator[Endpoint]:
    pools = {ALPHA: stack, BETA: lora_stack}
    http_port = free_port()
    launch = [
        *(sys.executable, "-m", "facade.launch", "--http-port", str(http_port)),
        *("--admin-port", str(free_port())),
        *(arg for name, pool in pools.items() for arg in ("--pool", f"{name}={pool.grpc_target}")),
        *("--pool-adapters", f"{BETA}={LATER_ADAPTERS}*"),
    ]
    envoy = subprocess.Popen(launch, env=LAUNCH_ENV)
    try:
        deadline = time.monotonic() + 120
        while listed_names(f"http://127.0.0.1:{http_port}") != set(OWNER):
            assert envoy.poll() is None, f"facade.launch exited with {envoy.returncode}"
            assert time.monotonic() < deadline, "the pools did not come up behind Envoy"
            time.sleep(0.5)
        yield Endpoint(pools, envoy, http_port)
    finally:
        stop_helpers([envoy])


@pytest.fixture(scope="module")
def stub(endpoint: Endpoint) -> Iterator[completions_pb2_grpc.CompletionServiceStub]:
    with grpc.insecure_channel(endpoint.grpc_target) as channel:
        yield completions_pb2_grpc.CompletionServiceStub(channel)


def direct_text(endpoint: Endpoint, model: str) -> str:
    """The greedy completion from the owning pool's replica itself, without Envoy."""
    with grpc.insecure_channel(endpoint.pools[OWNER[model]].grpc_target) as channel:
        stub = completions_pb2_grpc.CompletionServiceStub(channel)
        request = grpc_request(model=model, **GREEDY)
        (reply,) = stub.CreateCompletion(request, timeout=60, metadata=GRPC_AUTH)
    return reply.choices[0].text


@pytest.mark.parametrize("model", list(OWNER))
def test_each_call_reaches_the_pool_serving_its_model(
    endpoint: Endpoint, stub: completions_pb2_grpc.CompletionServiceStub, model: str
) -> None:
    expected = direct_text(endpoint, model)
    before = {pool: endpoint.served(pool, "CreateCompletion") for pool in endpoint.pools}
    rest = httpx.post(
        f"{endpoint.base_url}/v2/completions",
        json={"model": model, **GREEDY},
        headers=AUTH_HEADERS,
        timeout=60,
    )
    assert rest.status_code == 200, rest.text
    assert rest.json()["model"] == model
    assert rest.json()["choices"][0]["text"] == expected
    with httpx.stream(
        "POST",
        f"{endpoint.base_url}/v2/completions",
        json={"model": model, "stream": True, **GREEDY},
        headers=AUTH_HEADERS,
        timeout=60,
    ) as streamed:
        events = [line.removeprefix("data: ") for line in streamed.iter_lines() if line]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == expected
    (reply,) = stub.CreateCompletion(
        grpc_request(model=model, **GREEDY), timeout=60, metadata=GRPC_AUTH
    )
    assert reply.model == model and reply.choices[0].text == expected
    owner = OWNER[model]
    for pool, count in before.items():
        # Three calls through Envoy, plus nothing else: the direct call came before `before`.
        assert endpoint.served(pool, "CreateCompletion") == count + (3 if pool == owner else 0)


def test_the_adapter_and_the_base_models_differ(endpoint: Endpoint) -> None:
    # The routes matter only if the pools answer differently; the adapter changes the text.
    assert direct_text(endpoint, ADAPTER) != direct_text(endpoint, BETA)


def test_tokenize_and_model_information_reach_the_owning_pool(endpoint: Endpoint) -> None:
    before = endpoint.served(BETA, "Tokenize")
    tokens = httpx.post(
        f"{endpoint.base_url}/v2/tokenize",
        json={"model": ADAPTER, "prompt": CAPITAL_PROMPT},
        headers=AUTH_HEADERS,
        timeout=30,
    )
    assert tokens.status_code == 200, tokens.text
    assert tokens.json()["count"] == len(tokens.json()["tokens"]) > 0
    assert endpoint.served(BETA, "Tokenize") == before + 1
    info = httpx.get(f"{endpoint.base_url}/v2/models/{BETA}", headers=AUTH_HEADERS, timeout=30)
    assert info.json()["adapters"] == [ADAPTER, "a2"]


def test_every_pool_is_listed_on_both_surfaces(
    endpoint: Endpoint, stub: completions_pb2_grpc.CompletionServiceStub
) -> None:
    client = openai.OpenAI(base_url=f"{endpoint.base_url}/v2", api_key=API_KEY)
    listed = {model.id: model for model in client.models.list().data}
    assert set(listed) == set(OWNER)
    assert listed[ADAPTER].model_extra["parent"] == BETA
    assert client.models.retrieve(ADAPTER).model_extra["parent"] == BETA
    assert client.models.retrieve(ALPHA).model_extra["parent"] is None
    grpc_listing = stub.ListModels(ListModelsRequest(), timeout=30, metadata=GRPC_AUTH)
    assert {model.id for model in grpc_listing.data} == set(OWNER)


def test_a_listing_a_caller_passes_along_is_ignored(
    endpoint: Endpoint, stub: completions_pb2_grpc.CompletionServiceStub
) -> None:
    forged = ListModelsResponse(data=[Model(id="forged")]).SerializeToString()
    reply = httpx.get(
        f"{endpoint.base_url}/v2/models",
        headers={**AUTH_HEADERS, ENDPOINT_MODELS_HEADER: base64.b64encode(forged).decode()},
        timeout=30,
    )
    assert {model["id"] for model in reply.json()["data"]} == set(OWNER)
    metadata = (*GRPC_AUTH, (ENDPOINT_MODELS_HEADER, forged))
    grpc_listing = stub.ListModels(ListModelsRequest(), timeout=30, metadata=metadata)
    assert {model.id for model in grpc_listing.data} == set(OWNER)


class OneModelPool(completions_pb2_grpc.CompletionServiceServicer):
    """A pool's replica that serves one base model and answers only ListModels: the pool that
    goes away in the test below (the launcher needs it to answer at start)."""

    def ListModels(self, request: ListModelsRequest, context: object) -> ListModelsResponse:
        model = Model(id=STOPPED_POOL)
        model.parent.null_value = 0
        return ListModelsResponse(object="list", data=[model])


def test_a_pool_that_stops_answering_is_listed_as_at_launch(endpoint: Endpoint) -> None:
    replica = grpc.server(ThreadPoolExecutor(max_workers=4))
    completions_pb2_grpc.add_CompletionServiceServicer_to_server(OneModelPool(), replica)
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), replica)
    port = replica.add_insecure_port("127.0.0.1:0")
    replica.start()
    http_port, admin_port = free_port(), free_port()
    alpha = endpoint.pools[ALPHA].grpc_target
    launch = [
        *(sys.executable, "-m", "facade.launch", "--http-port", str(http_port)),
        *("--admin-port", str(admin_port)),
        *("--pool", f"{ALPHA}={alpha}", "--pool", f"{STOPPED_POOL}=127.0.0.1:{port}"),
    ]
    envoy = subprocess.Popen(launch, env=LAUNCH_ENV)
    base_url = f"http://127.0.0.1:{http_port}"
    try:
        deadline = time.monotonic() + 60
        while listed_names(base_url) != {ALPHA, STOPPED_POOL}:
            assert envoy.poll() is None, f"facade.launch exited with {envoy.returncode}"
            assert time.monotonic() < deadline, "the two pools were not listed"
            time.sleep(0.5)
        replica.stop(grace=None).wait()
        assert listed_names(base_url) == {ALPHA, STOPPED_POOL}
        assert lua_errors(f"http://127.0.0.1:{admin_port}") == 0
    finally:
        replica.stop(grace=None)
        stop_helpers([envoy])


def test_an_unknown_model_is_a_404_naming_every_pools_models(
    endpoint: Endpoint, stub: completions_pb2_grpc.CompletionServiceStub
) -> None:
    served = f"the served models are `{ALPHA}`, `{BETA}`, `{ADAPTER}`, `a2`."
    rest = httpx.post(
        f"{endpoint.base_url}/v2/completions",
        json={"model": "gamma", **GREEDY},
        headers=AUTH_HEADERS,
        timeout=30,
    )
    assert rest.status_code == 404
    assert rest.json() == {"detail": f"The model `gamma` does not exist; {served}"}
    with pytest.raises(grpc.RpcError) as raised:
        stub.GetModelInfo(GetModelInfoRequest(model="gamma"), timeout=30, metadata=GRPC_AUTH)
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND
    assert served in raised.value.details()


def test_grpcurl_reaches_each_pool_by_the_model_in_the_message(endpoint: Endpoint) -> None:
    for model in (ALPHA, ADAPTER):
        called = grpcurl(
            endpoint.grpc_target,
            "llmcompletions.v2.CompletionService/CreateCompletion",
            options=(
                *("-H", f"authorization: Bearer {API_KEY}"),
                *("-d", json.dumps({"model": model, **GREEDY})),
            ),
        )
        assert called.returncode == 0, called.stderr
        assert json.loads(called.stdout)["choices"][0]["text"] == direct_text(endpoint, model)


def run_launch(*pools: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "facade.launch", "--http-port", str(free_port())]
    command += [arg for pool in pools for arg in ("--pool", pool)]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env=LAUNCH_ENV)


def test_the_launcher_refuses_pools_it_cannot_route(endpoint: Endpoint) -> None:
    alpha = endpoint.pools[ALPHA].grpc_target
    misnamed = run_launch(f"gamma={alpha}")
    assert misnamed.returncode != 0
    assert f"pool 'gamma' serves base model(s) ['{ALPHA}']" in misnamed.stderr
    twice = run_launch(f"{ALPHA}={alpha}", f"{ALPHA}={alpha}")
    assert twice.returncode != 0
    assert f"model '{ALPHA}' is served by pools '{ALPHA}' and '{ALPHA}'" in twice.stderr


def listed_on_both_surfaces(
    endpoint: Endpoint, stub: completions_pb2_grpc.CompletionServiceStub
) -> tuple[set[str], set[str]]:
    """The endpoint's listing on REST, then on gRPC."""
    rest = listed_names(endpoint.base_url)
    grpc_listing = stub.ListModels(ListModelsRequest(), timeout=30, metadata=GRPC_AUTH)
    return rest, {model.id for model in grpc_listing.data}


def test_adapters_a_pool_gains_while_it_serves_are_routed_to_it_and_listed(
    endpoint: Endpoint,
    stub: completions_pb2_grpc.CompletionServiceStub,
    adapter_dirs: dict[str, Path],
) -> None:
    """Named by the pool's --pool-adapters pattern: one dropped into its adapter root, and one
    the operator loads through the endpoint (the load itself routed by the adapter's name).
    The endpoint's listing (and a 404's list of names) shows each while it is served, and not
    once it is retired."""
    root = adapter_root_of(adapter_dirs)
    staged = shutil.copytree(adapter_dirs["a2"], root / ".pool-staging")
    dropped, loaded = f"{LATER_ADAPTERS}dropped", f"{LATER_ADAPTERS}loaded"
    operator = {"Authorization": f"Bearer {OPERATOR_KEY}"}
    try:
        shutil.copytree(staged, root / dropped)
        for name in (dropped, loaded):
            if name == loaded:
                body = {"lora_name": loaded, "lora_path": str(staged)}
                reply = httpx.post(
                    f"{endpoint.base_url}/v2/load_lora_adapter",
                    json=body,
                    headers=operator,
                    timeout=120,
                )
                assert reply.status_code == 200 and reply.json()["replicas"] == 1, reply.text
            served = httpx.post(
                f"{endpoint.base_url}/v2/completions",
                json={"model": name, **GREEDY},
                headers=AUTH_HEADERS,
                timeout=120,
            )
            assert served.status_code == 200, served.text
            assert served.json()["model"] == name
        listed = {*OWNER, dropped, loaded}
        assert listed_on_both_surfaces(endpoint, stub) == (listed, listed)
        unknown = httpx.post(
            f"{endpoint.base_url}/v2/completions",
            json={"model": "no-such-model", **GREEDY},
            headers=AUTH_HEADERS,
            timeout=30,
        )
        assert unknown.status_code == 404  # naming what the pools serve now
        assert f"`{dropped}`" in unknown.json()["detail"] and f"`{loaded}`" in unknown.text
        unload = {"lora_name": loaded}
        reply = httpx.post(
            f"{endpoint.base_url}/v2/unload_lora_adapter",
            json=unload,
            headers=operator,
            timeout=120,
        )
        assert reply.status_code == 200, reply.text
        listed = {*OWNER, dropped}
        assert listed_on_both_surfaces(endpoint, stub) == (listed, listed)
        shutil.rmtree(root / dropped)
        deadline = time.monotonic() + 30
        while listed_on_both_surfaces(endpoint, stub) != (set(OWNER), set(OWNER)):
            assert time.monotonic() < deadline, f"{dropped} is still listed, its directory gone"
            time.sleep(0.5)
    finally:
        shutil.rmtree(root / dropped, ignore_errors=True)
        shutil.rmtree(staged)
