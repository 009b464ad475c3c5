"""Two base models behind one Envoy: pool `alpha` (one replica) and pool `beta` (one replica,
with the LoRA adapter `beta-sql`), started together with `facade.launch --pool ...` as in a
fresh deploy. Each call reaches the pool serving its `model` on REST and gRPC, with nothing
but the request itself to go by; the listing, the 404 and grpcurl see every pool's models."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from llmcompletions.v2 import completions_pb2_grpc
from llmcompletions.v2.completions_pb2 import GetModelInfoRequest, ListModelsRequest

from tests.conftest import ENGINE_START_TIMEOUT, SMALL_ENGINE
from tests.helpers import CAPITAL_PROMPT, grpc_request
from tests.metrics import scrape
from tests.processes import TestStack, free_port
from tests.test_adapters import build_adapter
from tests.test_grpc_tooling import grpcurl

ADAPTER = "beta-sql"
OWNER = {"alpha": "alpha", "beta": "beta", ADAPTER: "beta"}
GREEDY = {"prompt": CAPITAL_PROMPT, "max_tokens": 6, "temperature": 0}


@dataclass
class Endpoint:
    pools: dict[str, TestStack]
    metrics_ports: dict[str, int]
    envoy: subprocess.Popen[bytes]
    http_port: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    def metrics_url(self, pool: str) -> str:
        return f"http://127.0.0.1:{self.metrics_ports[pool]}/metrics"

    def served(self, pool: str, method: str) -> float:
        """The calls of `method` that the pool's replica has answered, whatever their status."""
        return sum(
            value
            for (name, labels), value in scrape(self.metrics_url(pool)).items()
            if name == "llmcompletions_requests_total" and ("method", method) in labels
        )


def pool_stack(
    name: str, extra: list[str], metrics_port: int, log_dir: Path, core: int
) -> TestStack:
    return TestStack(
        grpc_port=free_port(),
        service_args=[
            *SMALL_ENGINE,
            *("--cpu-cores", str(core)),  # each replica of this host on a core of its own
            *("--served-model-name", name),
            *extra,
            *("--metrics-port", str(metrics_port)),
        ],
        service_log=log_dir / f"{name}.log",
    )


def listed_names(base_url: str) -> set[str]:
    try:
        reply = httpx.get(f"{base_url}/v2/models", timeout=5)
    except httpx.HTTPError:
        return set()
    return {model["id"] for model in reply.json()["data"]} if reply.status_code == 200 else set()


@pytest.fixture(scope="module")
def endpoint(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Endpoint]:
    root = tmp_path_factory.mktemp("pools")
    adapter = build_adapter(model_dir, root / ADAPTER, seed=3)
    metrics_ports = {"alpha": free_port(), "beta": free_port()}
    extra = {"alpha": [], "beta": ["--lora-modules", f"{ADAPTER}={adapter}"]}
    pools = {
        name: pool_stack(name, extra[name], metrics_ports[name], root, core)
        for core, name in enumerate(metrics_ports)
    }
    http_port = free_port()
    launch = [
        *(sys.executable, "-m", "facade.launch", "--http-port", str(http_port)),
        *("--admin-port", str(free_port())),
        *(
            arg
            for name, stack in pools.items()
            for arg in ("--pool", f"{name}={stack.grpc_target}")
        ),
    ]
    for stack in pools.values():
        stack.start(with_envoy=False)
    # Envoy's launcher starts with the replicas and waits for each pool to list its models.
    envoy = subprocess.Popen(launch)
    try:
        deadline = time.monotonic() + ENGINE_START_TIMEOUT
        while listed_names(f"http://127.0.0.1:{http_port}") != set(OWNER):
            assert envoy.poll() is None, f"facade.launch exited with {envoy.returncode}"
            for stack in pools.values():
                stack.check_alive()
            assert time.monotonic() < deadline, "the pools did not come up behind Envoy"
            time.sleep(1.0)
        yield Endpoint(pools, metrics_ports, envoy, http_port)
    finally:
        envoy.terminate()
        envoy.wait(timeout=30)
        for stack in pools.values():
            stack.stop()


@pytest.fixture(scope="module")
def stub(endpoint: Endpoint) -> Iterator[completions_pb2_grpc.CompletionServiceStub]:
    with grpc.insecure_channel(endpoint.grpc_target) as channel:
        yield completions_pb2_grpc.CompletionServiceStub(channel)


def direct_text(endpoint: Endpoint, model: str) -> str:
    """The greedy completion from the owning pool's replica itself, without Envoy."""
    with grpc.insecure_channel(endpoint.pools[OWNER[model]].grpc_target) as channel:
        stub = completions_pb2_grpc.CompletionServiceStub(channel)
        (reply,) = stub.CreateCompletion(grpc_request(model=model, **GREEDY), timeout=60)
    return reply.choices[0].text


@pytest.mark.parametrize("model", list(OWNER))
def test_each_call_reaches_the_pool_serving_its_model(
    endpoint: Endpoint, stub: completions_pb2_grpc.CompletionServiceStub, model: str
) -> None:
    expected = direct_text(endpoint, model)
    before = {pool: endpoint.served(pool, "CreateCompletion") for pool in endpoint.pools}
    rest = httpx.post(
        f"{endpoint.base_url}/v2/completions", json={"model": model, **GREEDY}, timeout=60
    )
    assert rest.status_code == 200, rest.text
    assert rest.json()["model"] == model
    assert rest.json()["choices"][0]["text"] == expected
    with httpx.stream(
        "POST",
        f"{endpoint.base_url}/v2/completions",
        json={"model": model, "stream": True, **GREEDY},
        timeout=60,
    ) as streamed:
        events = [line.removeprefix("data: ") for line in streamed.iter_lines() if line]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == expected
    (reply,) = stub.CreateCompletion(grpc_request(model=model, **GREEDY), timeout=60)
    assert reply.model == model and reply.choices[0].text == expected
    owner = OWNER[model]
    for pool, count in before.items():
        # Three calls through Envoy, plus nothing else: the direct call came before `before`.
        assert endpoint.served(pool, "CreateCompletion") == count + (3 if pool == owner else 0)


def test_the_adapter_and_the_base_models_differ(endpoint: Endpoint) -> None:
    # The routes matter only if the pools answer differently; the adapter changes the text.
    assert direct_text(endpoint, ADAPTER) != direct_text(endpoint, "beta")


def test_tokenize_and_model_information_reach_the_owning_pool(endpoint: Endpoint) -> None:
    before = endpoint.served("beta", "Tokenize")
    tokens = httpx.post(
        f"{endpoint.base_url}/v2/tokenize",
        json={"model": ADAPTER, "prompt": CAPITAL_PROMPT},
        timeout=30,
    )
    assert tokens.status_code == 200, tokens.text
    assert tokens.json()["count"] == len(tokens.json()["tokens"]) > 0
    assert endpoint.served("beta", "Tokenize") == before + 1
    info = httpx.get(f"{endpoint.base_url}/v2/models/beta", timeout=30).json()
    assert info["adapters"] == [ADAPTER]


def test_every_pool_is_listed_on_both_surfaces(
    endpoint: Endpoint, stub: completions_pb2_grpc.CompletionServiceStub
) -> None:
    client = openai.OpenAI(base_url=f"{endpoint.base_url}/v2", api_key="unused")
    listed = {model.id: model for model in client.models.list().data}
    assert set(listed) == set(OWNER)
    assert listed[ADAPTER].model_extra["parent"] == "beta"
    assert client.models.retrieve(ADAPTER).model_extra["parent"] == "beta"
    assert client.models.retrieve("alpha").model_extra["parent"] is None
    grpc_listing = stub.ListModels(ListModelsRequest(), timeout=30)
    assert {model.id for model in grpc_listing.data} == set(OWNER)


def test_an_unknown_model_is_a_404_naming_every_pools_models(
    endpoint: Endpoint, stub: completions_pb2_grpc.CompletionServiceStub
) -> None:
    served = "the served models are `alpha`, `beta`, `beta-sql`."
    rest = httpx.post(
        f"{endpoint.base_url}/v2/completions", json={"model": "gamma", **GREEDY}, timeout=30
    )
    assert rest.status_code == 404
    assert rest.json() == {"detail": f"The model `gamma` does not exist; {served}"}
    with pytest.raises(grpc.RpcError) as raised:
        stub.GetModelInfo(GetModelInfoRequest(model="gamma"), timeout=30)
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND
    assert served in raised.value.details()


def test_grpcurl_reaches_each_pool_by_the_model_in_the_message(endpoint: Endpoint) -> None:
    for model in ("alpha", ADAPTER):
        called = grpcurl(
            endpoint.grpc_target,
            "llmcompletions.v2.CompletionService/CreateCompletion",
            options=("-d", json.dumps({"model": model, **GREEDY})),
        )
        assert called.returncode == 0, called.stderr
        assert json.loads(called.stdout)["choices"][0]["text"] == direct_text(endpoint, model)


def run_launch(*pools: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "facade.launch", "--http-port", str(free_port())]
    command += [arg for pool in pools for arg in ("--pool", pool)]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_the_launcher_refuses_pools_it_cannot_route(endpoint: Endpoint) -> None:
    alpha = endpoint.pools["alpha"].grpc_target
    misnamed = run_launch(f"gamma={alpha}")
    assert misnamed.returncode != 0
    assert "pool 'gamma' serves base model(s) ['alpha']" in misnamed.stderr
    twice = run_launch(f"alpha={alpha}", f"alpha={alpha}")
    assert twice.returncode != 0
    assert "model 'alpha' is served by pools 'alpha' and 'alpha'" in twice.stderr
