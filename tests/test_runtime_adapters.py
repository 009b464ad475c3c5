"""Adapters that come and go while a replica serves, on the real engine behind Envoy: an adapter
root served by directory name, LoadLoraAdapter / UnloadLoraAdapter for the operator key on both
surfaces, unloads that let running calls finish, versions that never share stale weights or
cache, eviction through the engine's memory slots, and each error with its own status.

The LoRA stack (tests/conftest.py) serves a1 and a2 from start, with two more adapters in the
engine's memory for runtime ones (--max-cpu-loras' default), an empty adapter root and
--max-adapters 8, --max-adapter-bytes 20 MB. Every adapter here is put away at the end: other
modules list the stack's models."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from llmcompletions.v2 import completions_pb2_grpc
from llmcompletions.v2.completions_pb2 import LoadLoraAdapterRequest, UnloadLoraAdapterRequest

from tests.conftest import LORA_MODEL, OPERATOR_KEY, adapter_root_of
from tests.helpers import CAPITAL_PROMPT, grpc_complete
from tests.metrics import scrape
from tests.models import build_adapter
from tests.processes import TestStack
from tests.test_readme_calls import FENCE, README, commands
from tests.test_vllm_parity import assert_logprobs_close

OPERATOR = {"Authorization": f"Bearer {OPERATOR_KEY}"}
GRPC_OPERATOR = (("authorization", f"Bearer {OPERATOR_KEY}"),)
SEEDS = {"s3": 3, "s4": 4, "s5": 5}  # adapters built here, besides copies of a1 and a2
ROOT_POLL_SECONDS = 10  # the root is scanned every second; a bound for a hang, not a speed
# Long enough to span the prefix cache's blocks (a version switch must not reuse them).
LONG_PROMPT = " ".join(f"Item {index} is on the shelf." for index in range(30))


@pytest.fixture(scope="module")
def rest(lora_stack: TestStack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=lora_stack.base_url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def root(adapter_dirs: dict[str, Path], lora_stack: TestStack) -> Iterator[Path]:
    """The stack's adapter root, emptied again (and every adapter loaded here unloaded) after
    the module."""
    root = adapter_root_of(adapter_dirs)
    yield root
    for entry in root.iterdir():
        shutil.rmtree(entry)
    with httpx.Client(base_url=lora_stack.base_url, timeout=30) as client:
        # Until the stack lists only what it served at start (the root is scanned every
        # second): the next module discovers its models.
        wait_for(
            lambda: listed(client) == [LORA_MODEL, *adapter_dirs], "the root's adapters stayed"
        )


@pytest.fixture(scope="module")
def sources(model_dir: Path, adapter_dirs: dict[str, Path], root: Path) -> dict[str, Path]:
    """Adapter directories inside the root but hidden from it (a dot directory), to load by
    path: copies of a1 and a2, and three more."""
    staging = root / ".staging"
    made = {name: shutil.copytree(path, staging / name) for name, path in adapter_dirs.items()}
    for name, seed in SEEDS.items():
        made[name] = build_adapter(model_dir, staging / name, seed)
    return made


@pytest.fixture(scope="module")
def stub(lora_stack: TestStack) -> Iterator[completions_pb2_grpc.CompletionServiceStub]:
    with grpc.insecure_channel(lora_stack.grpc_target) as channel:
        yield completions_pb2_grpc.CompletionServiceStub(channel)


@pytest.fixture
def loaded(rest: httpx.Client) -> Iterator[list[str]]:
    """Names a test loads by call, unloaded after it."""
    names: list[str] = []
    yield names
    for name in names:
        rest.post("/v2/unload_lora_adapter", json={"lora_name": name}, headers=OPERATOR)


def load(rest: httpx.Client, name: str, path: Path | str, **fields: Any) -> httpx.Response:
    payload = {"lora_name": name, "lora_path": str(path), **fields}
    return rest.post("/v2/load_lora_adapter", json=payload, headers=OPERATOR)


def unload(rest: httpx.Client, name: str) -> httpx.Response:
    return rest.post("/v2/unload_lora_adapter", json={"lora_name": name}, headers=OPERATOR)


def completion(rest: httpx.Client, model: str, **fields: Any) -> dict[str, Any]:
    payload = {"model": model, "prompt": CAPITAL_PROMPT, "temperature": 0, "max_tokens": 16}
    response = rest.post("/v2/completions", json={**payload, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def text(rest: httpx.Client, model: str, **fields: Any) -> str:
    return completion(rest, model, **fields)["choices"][0]["text"]


def listed(rest: httpx.Client) -> list[str]:
    return [model["id"] for model in rest.get("/v2/models").json()["data"]]


def wait_for(condition: Any, what: str) -> None:
    deadline = time.monotonic() + ROOT_POLL_SECONDS
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def drop_into_root(root: Path, name: str, source: Path) -> Path:
    """Copied in as an operator should: whole, under a hidden name, then renamed."""
    hidden = shutil.copytree(source, root / f".{name}.partial")
    return hidden.rename(root / name)


def resident(lora_stack: TestStack) -> set[str]:
    """The adapters the replica says its engine holds in memory."""
    samples = scrape(lora_stack.metrics_url)
    return {
        dict(labels)["adapter"]
        for (name, labels), value in samples.items()
        if name == "llmcompletions_adapter_resident" and value == 1
    }


# ---- loading, by call and from the root


def test_a_runtime_loaded_adapter_equals_the_same_adapter_given_at_start(
    rest: httpx.Client, sources: dict[str, Path], loaded: list[str]
) -> None:
    response = load(rest, "rt-a1", sources["a1"])
    assert response.status_code == 200, response.text
    loaded.append("rt-a1")
    assert response.json() == {
        "lora_name": "rt-a1",
        "object": "lora_adapter.loaded",
        "replicas": 1,
    }
    assert "rt-a1" in listed(rest)
    fields = {"logprobs": 3, "max_tokens": 24}
    runtime, start = completion(rest, "rt-a1", **fields), completion(rest, "a1", **fields)
    assert runtime["model"] == "rt-a1"
    assert runtime["choices"][0]["text"] == start["choices"][0]["text"]
    assert_logprobs_close(runtime["choices"][0]["logprobs"], start["choices"][0]["logprobs"])
    assert runtime["choices"][0]["text"] != text(rest, LORA_MODEL, max_tokens=24)
    assert chat_text(rest, "rt-a1") == chat_text(rest, "a1") != chat_text(rest, LORA_MODEL)


def chat_text(rest: httpx.Client, model: str) -> str:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    payload = {"model": model, "messages": messages, "temperature": 0, "max_tokens": 16}
    response = rest.post("/v2/chat/completions", json=payload)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def test_load_and_unload_over_grpc(
    stub: completions_pb2_grpc.CompletionServiceStub, sources: dict[str, Path], rest: httpx.Client
) -> None:
    reply = stub.LoadLoraAdapter(
        LoadLoraAdapterRequest(lora_name="rt-grpc", lora_path=str(sources["a2"])),
        metadata=GRPC_OPERATOR,
        timeout=60,
    )
    assert (reply.lora_name, reply.object, reply.replicas) == ("rt-grpc", "lora_adapter.loaded", 1)
    (ours,) = grpc_complete(stub, model="rt-grpc", prompt=CAPITAL_PROMPT, max_tokens=16)
    assert ours.choices[0].text == text(rest, "a2")
    reply = stub.UnloadLoraAdapter(
        UnloadLoraAdapterRequest(lora_name="rt-grpc"), metadata=GRPC_OPERATOR, timeout=60
    )
    assert reply.object == "lora_adapter.unloaded"
    with pytest.raises(grpc.RpcError) as caught:
        grpc_complete(stub, model="rt-grpc", prompt=CAPITAL_PROMPT, max_tokens=4)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


def test_an_adapter_dropped_into_the_root_is_served_by_name_then_retired_when_removed(
    rest: httpx.Client, root: Path, sources: dict[str, Path], lora_stack: TestStack
) -> None:
    directory = drop_into_root(root, "dropped", sources["a2"])
    assert text(rest, "dropped") == text(rest, "a2")  # no call: served at once
    wait_for(lambda: "dropped" in listed(rest), "the listing never showed the root's adapter")
    assert "dropped" in resident(lora_stack)
    shutil.rmtree(directory)
    wait_for(lambda: "dropped" not in listed(rest), "the removed adapter stayed listed")
    response = rest.post("/v2/completions", json={"model": "dropped", "prompt": "Hi"})
    assert response.status_code == 404
    wait_for(lambda: "dropped" not in resident(lora_stack), "its engine copy was never freed")


# ---- unloading and versions


def stream_in_background(
    rest: httpx.Client, model: str, first_chunk: threading.Event, **fields: Any
) -> tuple[threading.Thread, dict[str, Any]]:
    """A greedy stream on `model`, read in a thread: its text, finish reasons and error."""
    outcome: dict[str, Any] = {"text": "", "finish": [], "error": None}
    payload = {"model": model, "prompt": CAPITAL_PROMPT, "temperature": 0, "stream": True}

    def read() -> None:
        with rest.stream("POST", "/v2/completions", json={**payload, **fields}) as response:
            outcome["status"] = response.status_code
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                outcome["error"] = outcome["error"] or chunk.get("error")
                for choice in chunk.get("choices") or []:
                    outcome["text"] += choice["text"]
                    if choice.get("finish_reason"):
                        outcome["finish"].append(choice["finish_reason"])
                first_chunk.set()

    thread = threading.Thread(target=read)
    thread.start()
    return thread, outcome


def test_an_unload_lets_a_running_stream_finish_then_refuses_and_frees_the_adapter(
    rest: httpx.Client, sources: dict[str, Path], lora_stack: TestStack
) -> None:
    assert load(rest, "rt-gone", sources["s3"]).status_code == 200
    expected = text(rest, "rt-gone", max_tokens=32)
    started = threading.Event()
    reader, outcome = stream_in_background(rest, "rt-gone", started, max_tokens=32)
    assert started.wait(60), "the stream sent nothing"
    response = unload(rest, "rt-gone")  # returns once the stream ended and the copy is gone
    assert response.status_code == 200, response.text
    assert response.json()["object"] == "lora_adapter.unloaded"
    reader.join(60)
    assert outcome["status"] == 200 and outcome["error"] is None
    assert (outcome["text"], outcome["finish"]) == (expected, ["length"])
    refused = rest.post("/v2/completions", json={"model": "rt-gone", "prompt": "Hi"})
    assert refused.status_code == 404
    assert "rt-gone" not in listed(rest)
    assert "rt-gone" not in resident(lora_stack)
    assert unload(rest, "rt-gone").status_code == 404


def cached_tokens(reply: dict[str, Any]) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_new_version_serves_new_weights_without_the_old_cache_while_the_old_finishes(
    rest: httpx.Client, sources: dict[str, Path], loaded: list[str]
) -> None:
    assert load(rest, "rt-v", sources["s3"]).status_code == 200
    loaded.append("rt-v")
    old = completion(rest, "rt-v", prompt=LONG_PROMPT, max_tokens=12)
    assert cached_tokens(completion(rest, "rt-v", prompt=LONG_PROMPT, max_tokens=12)) > 0
    old_stream = text(rest, "rt-v", max_tokens=32)
    started = threading.Event()
    reader, outcome = stream_in_background(rest, "rt-v", started, max_tokens=32)
    assert started.wait(60), "the stream sent nothing"
    switched = load(rest, "rt-v", sources["s4"], load_inplace=True)
    assert switched.status_code == 200, switched.text
    new = completion(rest, "rt-v", prompt=LONG_PROMPT, max_tokens=12)
    assert cached_tokens(new) == 0  # no block of the old version's cache
    assert new["choices"][0]["text"] != old["choices"][0]["text"]
    assert load(rest, "rt-s4", sources["s4"]).status_code == 200
    loaded.append("rt-s4")
    assert new["choices"][0]["text"] == text(rest, "rt-s4", prompt=LONG_PROMPT, max_tokens=12)
    reader.join(60)
    assert (outcome["text"], outcome["error"]) == (old_stream, None)


def test_three_adapters_cycled_through_two_memory_slots_all_stay_correct(
    rest: httpx.Client, root: Path, sources: dict[str, Path]
) -> None:
    names = list(SEEDS)
    directories = [drop_into_root(root, f"cycle-{name}", sources[name]) for name in names]
    models = [directory.name for directory in directories]
    first = {model: text(rest, model) for model in models}
    assert len(set(first.values())) == len(models)
    for model in models:  # each evicted meanwhile, and loaded again
        assert text(rest, model) == first[model]
    mixed = [*models, LORA_MODEL, "a1"] * 3
    base = text(rest, LORA_MODEL)
    expected = {**first, LORA_MODEL: base, "a1": text(rest, "a1")}
    with ThreadPoolExecutor(len(mixed)) as pool:
        together = list(pool.map(lambda model: text(rest, model), mixed))
    assert together == [expected[model] for model in mixed]  # the base model's stays its own
    for directory in directories:
        shutil.rmtree(directory)


# ---- refusals, each with its own status, and the server serves on


def adapter_like(source: Path, target: Path, **config: Any) -> Path:
    """A copy of `source` with its adapter_config.json changed."""
    copy = shutil.copytree(source, target)
    path = copy / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return copy


def test_bad_loads_are_refused_each_with_its_status(
    rest: httpx.Client, root: Path, sources: dict[str, Path], tmp_path: Path, model_dir: Path
) -> None:
    staging, a1 = root / ".staging", sources["a1"]
    bad = {
        "dora": adapter_like(a1, staging / "dora", use_dora=True),
        "bias": adapter_like(a1, staging / "bias", bias="all"),
        "saves": adapter_like(a1, staging / "saves", modules_to_save=["lm_head"]),
        "other-base": adapter_like(a1, staging / "other", base_model_name_or_path="gpt2"),
        "not-lora": adapter_like(a1, staging / "ia3", peft_type="IA3"),
        "rank": adapter_like(a1, staging / "rank", r=32),
        # o_proj has no LoRA layer on this server (--lora-target-modules q_proj,v_proj).
        "untargeted": build_adapter(model_dir, staging / "o", 9, modules=("q_proj", "o_proj")),
    }
    big = shutil.copytree(a1, staging / "big")
    (big / "padding.bin").write_bytes(bytes(21_000_000))
    outside = shutil.copytree(a1, tmp_path / "outside")
    (staging / "link").symlink_to(outside)
    cases = [
        ("rt-missing", staging / "missing", 404, "not a directory"),
        ("rt-nofiles", shutil.copytree(a1, staging / "empty", ignore=ignore_weights), 404, "no "),
        *((f"rt-{kind}", path, 400, "") for kind, path in bad.items()),
        ("a1", a1, 409, "taken"),
        (LORA_MODEL, a1, 409, "taken"),
        ("rt-outside", outside, 403, "outside the adapter root"),
        ("rt-link", staging / "link", 403, "outside the adapter root"),
        ("rt-relative", "a1", 403, "absolute path"),
        ("rt-big", big, 429, "--max-adapter-bytes"),
    ]
    for name, path, status, words in cases:
        response = load(rest, name, path)
        assert response.status_code == status, (name, response.text)
        assert f"`{name}`" in response.json()["detail"] and words in response.json()["detail"]
    rank = load(rest, "rt-rank", bad["rank"]).json()["detail"]
    assert "raise --max-lora-rank to at least 32" in rank
    untargeted = load(rest, "rt-untargeted", bad["untargeted"]).json()["detail"]
    assert "changes o_proj, which this server gives no LoRA layer" in untargeted
    assert unload(rest, "rt-never").status_code == 404
    missing = rest.post("/v2/load_lora_adapter", json={"lora_name": "x"}, headers=OPERATOR)
    assert missing.status_code == 422 and missing.json()["detail"][0]["loc"] == [
        "body",
        "lora_path",
    ]
    assert text(rest, "a1") and text(rest, LORA_MODEL)  # the server serves on


def ignore_weights(directory: str, names: list[str]) -> list[str]:
    return [name for name in names if name.startswith("adapter_model")]


def test_loads_past_max_adapters_are_refused(
    rest: httpx.Client, sources: dict[str, Path], loaded: list[str]
) -> None:
    for index in range(9):  # --max-adapters 8, some perhaps loaded by other tests
        response = load(rest, f"rt-many-{index}", sources["s5"])
        if response.status_code != 200:
            break
        loaded.append(f"rt-many-{index}")
    assert response.status_code == 429, response.text
    assert "--max-adapters" in response.json()["detail"]


def test_only_the_operator_key_may_load_or_unload(
    rest: httpx.Client, sources: dict[str, Path]
) -> None:
    body = {"lora_name": "rt-auth", "lora_path": str(sources["a1"])}
    assert rest.post("/v2/load_lora_adapter", json=body).status_code == 401
    wrong = {"Authorization": "Bearer not-the-operator"}
    assert rest.post("/v2/load_lora_adapter", json=body, headers=wrong).status_code == 401
    assert rest.post("/v2/unload_lora_adapter", json=body, headers=wrong).status_code == 401
    assert "rt-auth" not in listed(rest)


def test_the_readme_adapter_calls_work_as_written(
    root: Path, sources: dict[str, Path], lora_stack: TestStack, tmp_path: Path
) -> None:
    """The README's "LoRA adapters" calls, with only the stack's root, port and key put in."""
    section = README.split("\n## LoRA adapters\n", 1)[1].split("\n## ", 1)[0]
    serve, calls = [text for _, text in FENCE.findall(section)]
    assert serve.startswith("ADAPTER_ROOT=/srv/adapters ENABLE_ADAPTER_LOADING=1")
    shutil.copytree(sources["a1"], tmp_path / "my-adapter")
    script = (
        calls.replace("/srv/adapters", str(root))
        .replace("http://127.0.0.1:8080", lora_stack.base_url)
        .replace("change-me", OPERATOR_KEY)
    )
    outputs = [
        subprocess.run(
            ["bash", "-c", command], capture_output=True, text=True, timeout=120, cwd=tmp_path
        ).stdout
        for command in commands(script)
    ]
    _, completed, loaded_reply, unloaded_reply = outputs
    assert json.loads(completed)["model"] == "my-adapter"
    assert json.loads(loaded_reply)["object"] == "lora_adapter.loaded"
    assert json.loads(unloaded_reply)["object"] == "lora_adapter.unloaded"
    shutil.rmtree(root / "my-adapter")
