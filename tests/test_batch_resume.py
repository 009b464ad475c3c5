"""A batch job survives its replicas: two replicas share a batch root; the one running the job
is SIGKILLed mid-job and the other takes the job over; then that one is SIGKILLed too (no
replica left), and `llm-completions batch run` on the same files starts a replica on the root
that resumes the job where its durable record ends. The output holds every line exactly once,
and no recorded line ran again."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from google.protobuf import json_format
from llmcompletions.v2 import completions_pb2_grpc
from llmcompletions.v2.completions_pb2 import (
    BatchCompletionJob,
    CreateBatchCompletionRequest,
    GetBatchCompletionRequest,
)

from service.api.batch.store import JOBS_DIRECTORY, JobStore
from tests.conftest import ENGINE_START_TIMEOUT, MODEL, SMALL_ENGINE, on_free_ports
from tests.engines import STARTS
from tests.processes import TestStack

LINES = 160
JOB_SECONDS = 300
TAKEOVER_SECONDS = 1


def start(batch_root: Path, log: Path) -> TestStack:
    stack = on_free_ports(
        "batch-resume",
        [
            *SMALL_ENGINE,
            *("--batch-root", str(batch_root)),
            *("--batch-takeover-seconds", str(TAKEOVER_SECONDS)),
        ],
        log,
    )
    stack.start(with_envoy=False)
    stack.wait_ready_service(ENGINE_START_TIMEOUT)
    return stack


def kill(stack: TestStack) -> None:
    for process in stack.processes:
        process.send_signal(signal.SIGKILL)
    for process in stack.processes:
        process.wait(timeout=60)


def job(stack: TestStack, job_id: str) -> BatchCompletionJob:
    with grpc.insecure_channel(stack.grpc_target) as channel:
        stub = completions_pb2_grpc.BatchCompletionServiceStub(channel)
        request = GetBatchCompletionRequest(batch_completion_id=job_id)
        return stub.GetBatchCompletion(request, timeout=30).job


def recorded(root: Path, job_id: str) -> list[int]:
    record = root / JOBS_DIRECTORY / job_id / "results-0.jsonl"  # its only shard
    return [json.loads(line)["index"] for line in record.read_text().splitlines()]


def wait_until(what: str, done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + JOB_SECONDS
    while not done():
        assert time.monotonic() < deadline, f"waited {JOB_SECONDS} s for {what}"
        time.sleep(0.2)


def test_a_job_outlives_its_replicas(tmp_path: Path) -> None:
    root = tmp_path / "batch"
    root.mkdir()
    with ThreadPoolExecutor(2) as starting:
        first, second = starting.map(lambda name: start(root, tmp_path / f"{name}.log"), "ab")
    # Of different lengths, so that they end one after another rather than a window at once.
    lines = [
        {"prompt": f"Item {i}:", "max_tokens": 4 + 4 * (i % 16), "ignore_eos": True}
        for i in range(LINES)
    ]
    body = {"model_config": {"model": MODEL}, "content": lines, "output_data_path": "o.json"}
    try:
        with grpc.insecure_channel(first.grpc_target) as channel:
            stub = completions_pb2_grpc.BatchCompletionServiceStub(channel)
            request = json_format.ParseDict(body, CreateBatchCompletionRequest())
            job_id = stub.CreateBatchCompletion(request, timeout=60).job_id
        wait_until("5 lines", lambda: job(second, job_id).request_counts.completed >= 5)
        assert job(second, job_id).status == "running"  # the other replica answers for it
    finally:
        kill(first)
    by_first = recorded(root, job_id)
    try:
        wait_until("the takeover", lambda: len(recorded(root, job_id)) >= len(by_first) + 5)
    finally:
        kill(second)
    kept = recorded(root, job_id)
    assert len(kept) < LINES, "both kills came before the job's end"

    (root / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    STARTS.record("batch-resume")  # the command's own replica
    command = [sys.executable, "-m", "service", "batch", "run", str(root / "in.jsonl")]
    run = subprocess.run(
        [*command, str(root / "o.json"), *SMALL_ENGINE],
        capture_output=True,
        text=True,
        timeout=JOB_SECONDS + ENGINE_START_TIMEOUT,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"resuming {job_id}" in run.stderr
    assert f"completed: {LINES}/{LINES} lines done, 0 failed" in run.stderr
    finished = JobStore(root).load(job_id)
    assert finished is not None and finished.status == "completed"
    assert finished.completed == LINES and finished.failed == 0
    output = json.loads((root / "o.json").read_text())
    assert len(output) == LINES and all(len(item["choices"]) == 1 for item in output)
    indices = recorded(root, job_id)
    assert sorted(indices) == list(range(LINES)), "each line recorded once"
    assert indices[: len(kept)] == kept, "no line recorded before a kill ran again"
