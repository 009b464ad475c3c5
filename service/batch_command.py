"""`llm-completions batch run INPUT OUTPUT [serve options]`: a batch job on a local engine, for
offline use. It starts this service (`serve`, with the options given after the files) with
its batch root at the files' common directory, creates the job (or, if that root holds an
unfinished job writing OUTPUT, resumes it), shows its progress, and stops the service when the
job ends. The job runs as any other (the same runner, output and durable record): interrupted,
the same command resumes it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from llmcompletions.v2 import completions_pb2_grpc
from llmcompletions.v2.completions_pb2 import (
    BatchCompletionJob,
    CreateBatchCompletionRequest,
    ListBatchCompletionsRequest,
    ListModelsRequest,
    WatchBatchCompletionRequest,
)

from service.api.batch.store import TERMINAL

START_SECONDS = 1800.0  # as long as a replica's start may take (a large model)
STOP_SECONDS = 60.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def run_batch(input_file: Path, output_file: Path, serve_args: Sequence[str]) -> int:
    """Run the job to its end; the exit code (0: completed)."""
    if not input_file.is_file():
        print(f"batch: no such input file: {input_file}", file=sys.stderr)
        return 2
    input_file, output_file = input_file.resolve(), output_file.resolve()
    root = Path(os.path.commonpath([input_file.parent, output_file.parent]))
    port = free_port()
    command = [
        *(sys.executable, "-m", "service", "serve", "--host", "127.0.0.1"),
        *("--port", str(port), "--metrics-port", str(free_port()), "--batch-root", str(root)),
        *serve_args,
    ]
    server = subprocess.Popen(command)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            if not serving(channel, server):
                print("batch: the service did not start; see its log above", file=sys.stderr)
                return 1
            job = job_for(channel, input_file, output_file, root)
            return follow(channel, job, output_file)
    except KeyboardInterrupt:
        print("batch: interrupted; the same command resumes the job", file=sys.stderr)
        return 130
    finally:
        server.terminate()
        try:
            server.wait(STOP_SECONDS)
        except subprocess.TimeoutExpired:
            server.kill()


def serving(channel: grpc.Channel, server: subprocess.Popen[bytes]) -> bool:
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline and server.poll() is None:
        try:
            status = health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
        except grpc.RpcError:
            status = None
        if status == health_pb2.HealthCheckResponse.SERVING:
            return True
        time.sleep(1)
    return False


def job_for(
    channel: grpc.Channel, input_file: Path, output_file: Path, root: Path
) -> BatchCompletionJob:
    """The unfinished job writing `output_file` (resumed by the service), else a new one."""
    batch = completions_pb2_grpc.BatchCompletionServiceStub(channel)
    for job in batch.ListBatchCompletions(ListBatchCompletionsRequest(), timeout=60).jobs:
        if job.status not in TERMINAL and (root / job.output_data_path).resolve() == output_file:
            print(f"batch: resuming {job.job_id}", file=sys.stderr)
            return job
    models = completions_pb2_grpc.CompletionServiceStub(channel)
    model = models.ListModels(ListModelsRequest(), timeout=60).data[0].id
    request = CreateBatchCompletionRequest(
        input_data_path=str(input_file), output_data_path=str(output_file)
    )
    request.model_config.update({"model": model})
    job = batch.CreateBatchCompletion(request, timeout=600)
    print(f"batch: {job.job_id}: {job.request_counts.total} lines on {model}", file=sys.stderr)
    return job


def follow(channel: grpc.Channel, job: BatchCompletionJob, output_file: Path) -> int:
    batch = completions_pb2_grpc.BatchCompletionServiceStub(channel)
    watch = WatchBatchCompletionRequest(batch_completion_id=job.job_id)
    shown = 0.0
    for event in batch.WatchBatchCompletion(watch):
        job = event.job
        if job.status in TERMINAL or time.monotonic() - shown >= 1:
            counts = job.request_counts
            print(
                f"batch: {job.status}: {counts.completed + counts.failed}/{counts.total} lines "
                f"done, {counts.failed} failed",
                file=sys.stderr,
            )
            shown = time.monotonic()
    if job.status != "completed":
        print(f"batch: the job ended {job.status}: {job.error}", file=sys.stderr)
        return 1
    print(f"batch: output in {output_file}", file=sys.stderr)
    return 0
