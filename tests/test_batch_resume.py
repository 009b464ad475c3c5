"""A fleet runs batch jobs: two replicas share a batch root and an S3 bucket (a real
S3-compatible server on loopback).

- A job with data_parallelism 2, its input and output in the bucket, runs on both replicas at
  once, each line once.
- A job survives its replicas: the one running it is SIGKILLed mid-job and the other takes the
  job over; then that one is SIGKILLed too (no replica left), and `llm-completions batch run`
  on the same files starts a replica on the root that resumes the job where its durable record
  ends. The output holds every line exactly once, and no recorded line ran again."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import s3fs
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
from tests.metrics import sample
from tests.processes import TestStack
from tests.s3_server import S3Server, start_s3

LINES = 160
JOB_SECONDS = 300
TAKEOVER_SECONDS = 1
BUCKET = "s3://batch-jobs"


@dataclass
class Fleet:
    root: Path
    replicas: list[TestStack]
    s3: S3Server

    def bucket(self) -> s3fs.S3FileSystem:
        return s3fs.S3FileSystem(
            endpoint_url=self.s3.endpoint, key="test", secret="test", skip_instance_cache=True
        )


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """Two replicas on one batch root and one bucket (the second test kills both)."""
    directory = tmp_path_factory.mktemp("batch-fleet")
    root = directory / "batch"
    root.mkdir()
    s3 = start_s3(directory / "s3.log")
    try:
        with ThreadPoolExecutor(2) as starting:
            replicas = list(
                starting.map(lambda name: start(root, directory / f"{name}.log", s3), "ab")
            )
        try:
            yield Fleet(root, replicas, s3)
        finally:
            for replica in replicas:
                replica.stop()
    finally:
        s3.stop()


def start(batch_root: Path, log: Path, s3: S3Server) -> TestStack:
    stack = on_free_ports(
        "batch-resume",
        [
            *SMALL_ENGINE,
            *("--batch-root", str(batch_root), "--batch-buckets", BUCKET),
            *("--batch-takeover-seconds", str(TAKEOVER_SECONDS)),
        ],
        log,
        env=s3.client_environment,
    )
    stack.start(with_envoy=False)
    stack.wait_ready_service(ENGINE_START_TIMEOUT)
    return stack


def create(stack: TestStack, body: dict[str, Any]) -> str:
    with grpc.insecure_channel(stack.grpc_target) as channel:
        stub = completions_pb2_grpc.BatchCompletionServiceStub(channel)
        request = json_format.ParseDict(body, CreateBatchCompletionRequest())
        return str(stub.CreateBatchCompletion(request, timeout=60).job_id)


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


def recorded(root: Path, job_id: str, shard: int = 0) -> list[int]:
    record = root / JOBS_DIRECTORY / job_id / f"results-{shard}.jsonl"
    return [json.loads(line)["index"] for line in record.read_text().splitlines()]


def lines_done(stack: TestStack) -> float:
    return sample(stack.metrics_url, "llmcompletions_batch_lines_total", result="completed")


def test_a_jobs_lines_spread_over_the_replicas_its_files_in_a_bucket(fleet: Fleet) -> None:
    """data_parallelism 2: each replica runs a shard (its metrics count its lines), every line
    once; the input is read from the bucket and the output written there, in input order."""
    first, second = fleet.replicas
    lines = [
        # Long enough (seconds a shard) for the other replica's look for free shards (every
        # second here) to come before the creator is done with its own and takes the second.
        {"prompt": f"Item {i}:", "max_tokens": 48 + i % 7, "ignore_eos": True}
        for i in range(40)
    ]
    bucket = fleet.bucket()
    bucket.mkdir(BUCKET)
    bucket.pipe(
        f"{BUCKET}/in/lines.jsonl", "".join(json.dumps(line) + "\n" for line in lines).encode()
    )
    before = [lines_done(replica) for replica in fleet.replicas]
    body = {
        "model_config": {"model": MODEL},
        "input_data_path": f"{BUCKET}/in/lines.jsonl",
        "output_data_path": f"{BUCKET}/out/answers.json",
        "data_parallelism": 2,
    }
    job_id = create(first, body)
    wait_until("the job's end", lambda: job(second, job_id).status == "completed")
    ended = job(second, job_id)
    assert (ended.request_counts.completed, ended.request_counts.failed) == (40, 0)
    output = json.loads(bucket.cat(f"{BUCKET}/out/answers.json"))
    assert [item["usage"]["completion_tokens"] for item in output] == [
        line["max_tokens"] for line in lines
    ], "one answer a line, in input order"
    ran = [
        lines_done(replica) - earlier
        for replica, earlier in zip(fleet.replicas, before, strict=True)
    ]
    assert sum(ran) == 40 and min(ran) > 0, f"lines run by each replica: {ran}"
    shards = [recorded(fleet.root, job_id, shard) for shard in (0, 1)]
    assert sorted(shards[0] + shards[1]) == list(range(40)), "each line recorded once"

    outside = {**body, "output_data_path": "s3://another-bucket/answers.json"}
    with pytest.raises(grpc.RpcError) as refused:
        create(first, outside)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "output_data_path" in str(refused.value.details())


def wait_until(what: str, done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + JOB_SECONDS
    while not done():
        assert time.monotonic() < deadline, f"waited {JOB_SECONDS} s for {what}"
        time.sleep(0.2)


def test_a_job_outlives_its_replicas(fleet: Fleet) -> None:
    root = fleet.root
    # Of different lengths, so that they end one after another rather than a window at once.
    lines = [
        {"prompt": f"Item {i}:", "max_tokens": 4 + 4 * (i % 16), "ignore_eos": True}
        for i in range(LINES)
    ]
    body = {"model_config": {"model": MODEL}, "content": lines, "output_data_path": "o.json"}
    before = [lines_done(replica) for replica in fleet.replicas]
    job_id = create(fleet.replicas[0], body)
    wait_until("5 lines", lambda: job(fleet.replicas[1], job_id).request_counts.completed >= 5)
    # The other replica answers for it. The creator runs it, unless the other's look for free
    # shards came first: the one that runs it is killed.
    assert job(fleet.replicas[1], job_id).status == "running"
    ran = [lines_done(replica) for replica in fleet.replicas]
    first, second = fleet.replicas if ran[0] > before[0] else fleet.replicas[::-1]
    kill(first)
    by_first = recorded(root, job_id)
    wait_until("the takeover", lambda: len(recorded(root, job_id)) >= len(by_first) + 5)
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
