"""The session's small engine, watched from start to stop: health transitions, where it runs
(started with automatic binding beside the session's default stack, it warns that they share
cores and moves its engine core onto the cores vLLM bound its worker to), its worker's gloo
loops started with timer slack, JSON logs with prompts and with a caller's overlong model name
cut, `add_special_tokens` on a model whose tokenizer adds a BOS token, and a drain.

The default model's tokenizer adds no special tokens, so the small engine serves a variant of
it (the same weights; a tokenizer that prepends <|endoftext|>). tests/test_capacity.py uses
the engine before these tests (its priority scheduling is tested there); the last test here
stops it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2
from llmcompletions.v2 import completions_pb2_grpc

from service.model.gloo_timer_slack import GLOO_LOOP_SLACK_NS
from service.transport.observability import CALLER_TEXT_CHARS
from tests.conftest import BOS_MODEL, SmallStack
from tests.helpers import grpc_complete, grpc_request
from tests.processes import HealthWatch, thread_affinities

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class LifecycleService:
    process: subprocess.Popen[bytes]
    stub: completions_pb2_grpc.CompletionServiceStub
    health: HealthWatch
    log: Path


@pytest.fixture(scope="module")
def service(small_stack: SmallStack) -> Iterator[LifecycleService]:
    stack = small_stack.stack
    assert stack.service_log is not None
    with grpc.insecure_channel(stack.grpc_target) as channel:
        stub = completions_pb2_grpc.CompletionServiceStub(channel)
        yield LifecycleService(stack.processes[0], stub, small_stack.health, stack.service_log)


def test_health_turns_serving_only_once_the_engine_is_ready(service: LifecycleService) -> None:
    service.health.wait_for(SERVING, timeout=10)
    first_serving = service.health.statuses.index(SERVING)
    assert NOT_SERVING in service.health.statuses[:first_serving], service.health.statuses


def test_beside_another_engine_it_warns_and_binds_its_engine_in_one_process(
    service: LifecycleService,
) -> None:
    warnings = [
        entry["message"]
        for entry in map(json.loads, filter(is_json, service.log.read_text().splitlines()))
        if entry["level"] == "WARNING" and "beside another vLLM engine" in entry["message"]
    ]
    assert len(warnings) == 1 and "--cpu-cores" in warnings[0], warnings
    engines = [
        child
        for child in psutil.Process(service.process.pid).children(recursive=True)
        if child.name().startswith("VLLM::")
    ]
    # The worker runs in the engine core: one engine process, every thread of it bound.
    (engine_core,) = engines
    assert engine_core.name() == "VLLM::EngineCore"
    anywhere = os.sched_getaffinity(0)
    core_cores = thread_affinities(engine_core)
    assert all(cores == core_cores[0] for cores in core_cores)
    assert core_cores[0] < anywhere


def is_json(line: str) -> bool:
    return line.startswith("{")


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


@pytest.mark.parametrize("stream", [False, True])
def test_json_request_log_lines_carry_prompts_when_asked(
    service: LifecycleService, stream: bool
) -> None:
    """The request's log line has its prompt and its whole output, a streamed one's from every
    chunk."""
    replies = grpc_complete(
        service.stub, model=BOS_MODEL, prompt="Logged prompt", max_tokens=3, stream=stream
    )
    text = "".join(choice.text for reply in replies for choice in reply.choices)
    time.sleep(0.5)
    entries = [
        json.loads(line) for line in service.log.read_text().splitlines() if line.startswith("{")
    ]
    requests = [entry for entry in entries if entry["message"] == "request"]
    assert requests, "no JSON request lines"
    last = requests[-1]
    assert last["status"] == "OK" and last["model"] == BOS_MODEL
    assert last["stream"] is stream
    assert last["completion_tokens"] == 3
    assert "Logged prompt" in last["prompts"][0]
    assert last["output"] == text
    if not stream:
        assert last["prompt_tokens"] == replies[0].usage.prompt_tokens


def request_log_lines(log: Path) -> list[str]:
    return [line for line in log.read_text().splitlines() if '"message": "request"' in line]


def test_an_overlong_model_name_is_not_found_and_logged_cut(service: LifecycleService) -> None:
    """A caller naming a model of 100,000 characters gets NOT_FOUND, and the replica's log line
    for it stays short, saying how long the name was."""
    with pytest.raises(grpc.RpcError) as refused:
        grpc_complete(service.stub, model="m" * 100_000, prompt="Hi", max_tokens=1)
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    time.sleep(0.5)
    line = request_log_lines(service.log)[-1]
    entry = json.loads(line)
    assert entry["status"] == "NOT_FOUND"
    assert entry["model"] == "m" * CALLER_TEXT_CHARS + "... (100000 characters)"
    assert len(line) < 2_000


def thread_slack(pid: int) -> dict[str, set[int]]:
    """The timer slack of a process's threads, by thread name."""
    slack: dict[str, set[int]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        name = (task / "comm").read_text().strip()
        slack.setdefault(name, set()).add(int(Path(f"/proc/{task.name}/timerslack_ns").read_text()))
    return slack


def test_the_engine_cores_gloo_loops_wake_with_slack_and_nothing_else_does(
    service: LifecycleService,
) -> None:
    """The worker's gloo loop threads (inside the engine core) carry the timer slack that
    keeps an idle engine from waking a hundred times a second; the engine core's own thread
    and the server's keep the kernel's default."""
    server = psutil.Process(service.process.pid)
    slacks = {p.pid: thread_slack(p.pid) for p in server.children(recursive=True)}
    (core,) = [pid for pid, slack in slacks.items() if "gloo_tcp_loop" in slack]
    assert slacks[core]["gloo_tcp_loop"] == {GLOO_LOOP_SLACK_NS}
    default = int(Path(f"/proc/{server.pid}/timerslack_ns").read_text())
    assert default < GLOO_LOOP_SLACK_NS
    assert int(Path(f"/proc/{core}/timerslack_ns").read_text()) == default


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
