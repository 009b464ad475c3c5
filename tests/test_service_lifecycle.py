"""A second service, watched from start to stop: health transitions, JSON logs with prompts,
`add_special_tokens` on a model whose tokenizer adds a BOS token, and priority scheduling (it
runs with `--scheduling-policy priority` and one sequence at a time).

The default model's tokenizer adds no special tokens, so this service serves a variant of it
(the same weights; a tokenizer that prepends <|endoftext|>). Tests run in file order; the last
one stops the service.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from llmcompletions.v2 import completions_pb2_grpc

from tests.conftest import ENGINE_START_TIMEOUT, SMALL_ENGINE
from tests.helpers import grpc_complete, grpc_request
from tests.processes import TestStack, free_port

BOS_ID = 0
BOS_MODEL = "smollm2-with-bos"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def with_bos_tokenizer(model_dir: Path, target: Path) -> Path:
    target.mkdir()
    for item in model_dir.iterdir():
        if item.name != "tokenizer.json":
            os.symlink(item, target / item.name)
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {
            "<|endoftext|>": {"id": "<|endoftext|>", "ids": [BOS_ID], "tokens": ["<|endoftext|>"]}
        },
    }
    (target / "tokenizer.json").write_text(json.dumps(tokenizer))
    return target


@dataclass
class HealthWatch:
    """Every status the service's health Watch stream reports, from before it listens."""

    target: str
    statuses: list[int] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self.done.is_set():
            try:
                with grpc.insecure_channel(self.target) as channel:
                    stub = health_pb2_grpc.HealthStub(channel)
                    for reply in stub.Watch(health_pb2.HealthCheckRequest()):
                        self.statuses.append(reply.status)
            except grpc.RpcError:
                time.sleep(0.2)

    def wait_for(self, status: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while status not in self.statuses:
            assert time.monotonic() < deadline, f"health never reported {status}: {self.statuses}"
            time.sleep(0.1)


@dataclass
class LifecycleService:
    process: subprocess.Popen[bytes]
    stub: completions_pb2_grpc.CompletionServiceStub
    health: HealthWatch
    log: Path


@pytest.fixture(scope="module")
def service(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LifecycleService]:
    variant = with_bos_tokenizer(model_dir, tmp_path_factory.mktemp("bos") / "model")
    running = TestStack(
        grpc_port=free_port(),
        service_args=[
            *SMALL_ENGINE,
            "--model",
            str(variant),
            "--served-model-name",
            BOS_MODEL,
            "--metrics-port",
            str(free_port()),
            "--log-prompts",
            *("--scheduling-policy", "priority"),
            # One sequence at a time: a long request makes the others queue.
            *("--engine-args", '{"max_num_seqs": 1}'),
            # The drain ends when the stream in flight ends; the grace only bounds a stuck one.
            "--shutdown-grace",
            "60",
        ],
        env={"LOG_FORMAT": "json"},
        service_log=tmp_path_factory.getbasetemp() / "lifecycle-service.log",
    )
    health = HealthWatch(running.grpc_target)
    threading.Thread(target=health.run, daemon=True).start()
    running.start(with_envoy=False)
    try:
        running.wait_ready_service(ENGINE_START_TIMEOUT)
        with grpc.insecure_channel(running.grpc_target) as channel:
            stub = completions_pb2_grpc.CompletionServiceStub(channel)
            assert running.service_log is not None
            yield LifecycleService(running.processes[0], stub, health, running.service_log)
    finally:
        health.done.set()
        running.stop()


def test_health_turns_serving_only_once_the_engine_is_ready(service: LifecycleService) -> None:
    service.health.wait_for(SERVING, timeout=10)
    first_serving = service.health.statuses.index(SERVING)
    assert NOT_SERVING in service.health.statuses[:first_serving], service.health.statuses


def test_add_special_tokens_adds_the_bos_token(service: LifecycleService) -> None:
    request = {
        "model": BOS_MODEL,
        "prompt": "Hello world",
        "max_tokens": 1,
        "echo": True,
        "logprobs": 0,
    }
    (with_bos,) = grpc_complete(service.stub, **request)
    (default,) = grpc_complete(service.stub, **{**request, "add_special_tokens": True})
    (without,) = grpc_complete(service.stub, **{**request, "add_special_tokens": False})
    assert with_bos.usage.prompt_tokens == default.usage.prompt_tokens
    assert with_bos.usage.prompt_tokens == without.usage.prompt_tokens + 1
    assert with_bos.choices[0].logprobs.tokens[0] == "<|endoftext|>"
    assert without.choices[0].logprobs.tokens[0] != "<|endoftext|>"


def test_json_request_log_lines_carry_prompts_when_asked(service: LifecycleService) -> None:
    (result,) = grpc_complete(service.stub, model=BOS_MODEL, prompt="Logged prompt", max_tokens=3)
    time.sleep(0.5)
    entries = [
        json.loads(line) for line in service.log.read_text().splitlines() if line.startswith("{")
    ]
    requests = [entry for entry in entries if entry["message"] == "request"]
    assert requests, "no JSON request lines"
    last = requests[-1]
    assert last["status"] == "OK" and last["model"] == BOS_MODEL
    assert last["prompt_tokens"] == result.usage.prompt_tokens
    assert last["completion_tokens"] == 3
    assert "Logged prompt" in last["prompts"][0]
    assert last["output"] == result.choices[0].text


def test_a_high_priority_request_runs_before_a_low_priority_one_queued_first(
    service: LifecycleService,
) -> None:
    busy = service.stub.CreateCompletion(
        grpc_request(model=BOS_MODEL, prompt="Count:", max_tokens=80, ignore_eos=True, stream=True),
        timeout=120,
    )
    next(busy)  # the engine's one sequence slot is taken
    finished: dict[str, float] = {}

    def run(name: str, priority: int) -> None:
        grpc_complete(service.stub, model=BOS_MODEL, prompt=name, max_tokens=4, priority=priority)
        finished[name] = time.monotonic()

    low = threading.Thread(target=run, args=("low", 10))
    low.start()
    time.sleep(1.0)  # queued well before the high-priority one arrives
    high = threading.Thread(target=run, args=("high", -10))
    high.start()
    list(busy)
    for thread in (low, high):
        thread.join(timeout=120)
    assert finished["high"] < finished["low"], finished


def test_sigterm_drains_streams_in_flight_then_exits_cleanly(service: LifecycleService) -> None:
    in_flight = service.stub.CreateCompletion(
        grpc_request(model=BOS_MODEL, prompt="Count:", max_tokens=60, ignore_eos=True, stream=True),
        timeout=120,
    )
    first = next(in_flight)
    seen = len(service.health.statuses)
    service.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while NOT_SERVING not in service.health.statuses[seen:]:
        assert time.monotonic() < deadline, service.health.statuses
        time.sleep(0.05)
    with pytest.raises(grpc.RpcError) as refused:
        grpc_complete(service.stub, model=BOS_MODEL, prompt="Hi", max_tokens=1)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    rest = list(in_flight)
    tokens = len(first.choices) + sum(len(chunk.choices) for chunk in rest)
    assert tokens == 60, "the stream in flight must finish"
    assert rest[-1].choices[0].finish_reason == "length"
    assert service.process.wait(timeout=60) == 0
