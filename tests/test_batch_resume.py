"""A batch job survives its replica's crash: the whole stack SIGKILLed mid-job, then started
again on the same batch root, resumes the job where its durable record ends, and the output
holds every line exactly once."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import grpc
from google.protobuf import json_format
from llmcompletions.v2 import completions_pb2_grpc
from llmcompletions.v2.completions_pb2 import (
    BatchCompletionJob,
    CreateBatchCompletionRequest,
    GetBatchCompletionRequest,
)

from service.api.batch.store import JOBS_DIRECTORY
from tests.conftest import ENGINE_START_TIMEOUT, MODEL, SMALL_ENGINE, on_free_ports
from tests.processes import TestStack

LINES = 40
JOB_SECONDS = 300


def start(batch_root: Path, log: Path) -> TestStack:
    stack = on_free_ports("batch-resume", [*SMALL_ENGINE, "--batch-root", str(batch_root)], log)
    stack.start(with_envoy=False)
    stack.wait_ready_service(ENGINE_START_TIMEOUT)
    return stack


def job(stack: TestStack, job_id: str) -> BatchCompletionJob:
    with grpc.insecure_channel(stack.grpc_target) as channel:
        stub = completions_pb2_grpc.BatchCompletionServiceStub(channel)
        request = GetBatchCompletionRequest(batch_completion_id=job_id)
        return stub.GetBatchCompletion(request, timeout=30).job


def wait_for(stack: TestStack, job_id: str, done: int) -> BatchCompletionJob:
    deadline = time.monotonic() + JOB_SECONDS
    while time.monotonic() < deadline:
        current = job(stack, job_id)
        if current.request_counts.completed >= done or current.status == "completed":
            return current
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} did not get to {done} lines in {JOB_SECONDS} s")


def test_a_job_resumes_after_its_replica_is_killed(tmp_path: Path) -> None:
    root = tmp_path / "batch"
    root.mkdir()
    first = start(root, tmp_path / "first.log")
    try:
        lines = [
            {"prompt": f"Item {i}:", "max_tokens": 48, "ignore_eos": True, "temperature": 0}
            for i in range(LINES)
        ]
        body = {"model_config": {"model": MODEL}, "content": lines, "output_data_path": "o.json"}
        with grpc.insecure_channel(first.grpc_target) as channel:
            stub = completions_pb2_grpc.BatchCompletionServiceStub(channel)
            created = stub.CreateBatchCompletion(
                json_format.ParseDict(body, CreateBatchCompletionRequest()), timeout=60
            )
        before = wait_for(first, created.job_id, 5)
        assert before.status == "running"
    finally:
        for process in first.processes:
            process.send_signal(signal.SIGKILL)
        for process in first.processes:
            process.wait(timeout=60)
    record = root / JOBS_DIRECTORY / created.job_id / "results.jsonl"
    kept = [json.loads(line)["index"] for line in record.read_text().splitlines()]
    assert len(kept) < LINES, "the kill came before the job's end"

    second = start(root, tmp_path / "second.log")
    try:
        finished = wait_for(second, created.job_id, LINES)
        deadline = time.monotonic() + 30
        while finished.status != "completed" and time.monotonic() < deadline:
            time.sleep(0.2)
            finished = job(second, created.job_id)
    finally:
        second.stop()
    assert finished.status == "completed"
    assert finished.request_counts.completed == LINES and finished.request_counts.failed == 0
    output = json.loads((root / "o.json").read_text())
    assert len(output) == LINES and all(len(item["choices"]) == 1 for item in output)
    indices = [json.loads(line)["index"] for line in record.read_text().splitlines()]
    assert sorted(indices) == list(range(LINES)), "each line recorded once"
    assert indices[: len(kept)] == kept, "the lines done before the kill did not run again"
