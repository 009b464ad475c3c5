"""The batch API's logic: jobs created (their paths confined to the batch root or the allowed
buckets, their lines checked by the synchronous calls' own validation), read, listed, updated,
cancelled and watched by their owner only (anyone else: not found), and run by the Runner; a
replica takes up, at its start and then every few seconds, each job with a shard nobody runs."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timezone
from typing import Any

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message
from llmcompletions.v2.completions_pb2 import (
    BatchCompletionJob,
    BatchRequestCounts,
    CreateBatchCompletionRequest,
)

from service.api.batch.job_request import (
    EngineFacts,
    check_job_request,
    data_parallelism,
    max_runtime_sec,
    model_config_of,
    requests_of,
)
from service.api.batch.lines import Line, checked_lines, read_input_file
from service.api.batch.paths import confined
from service.api.batch.runner import Owner, Runner
from service.api.batch.store import CANCEL_MARKER, Job
from service.api.errors import CompletionError, RequestValidationError
from service.api.validation import Violations
from service.settings import BatchSettings

logger = logging.getLogger(__name__)

WATCH_POLL_SECONDS = 1.0
# How long a cancel waits for the job's lines in flight to stop and its output to be written.
CANCEL_WAIT_SECONDS = 10.0


class JobNotFoundError(CompletionError):
    grpc_code = grpc.StatusCode.NOT_FOUND

    def __init__(self, job_id: str) -> None:
        super().__init__(f"No batch job {job_id[:80]!r} of yours.")


def iso(moment: float | None) -> str | None:
    if moment is None:
        return None
    return datetime.fromtimestamp(moment, timezone.utc).isoformat()


def job_message(job: Job) -> BatchCompletionJob:
    message = BatchCompletionJob(
        job_id=job.job_id,
        status=job.status,
        output_data_path=job.output_data_path,
        created_at=iso(job.created_at) or "",
        expires_at=iso(job.expires_at) or "",
        metadata=job.labels,
        request_counts=BatchRequestCounts(
            total=job.total, completed=job.completed, failed=job.failed
        ),
    )
    message.model_config.update(job.model_config)
    for name, value in (
        ("input_data_path", job.input_data_path),
        ("priority", job.priority),
        ("completed_at", iso(job.completed_at)),
        ("error", job.error),
    ):
        if value is not None:
            setattr(message, name, value)
    return message


class BatchJobs:
    def __init__(
        self,
        settings: BatchSettings,
        runner: Runner,
        engine: EngineFacts,
        validate_line: Callable[[str, Message], None],
        serves: Callable[[str], bool] = lambda model: True,
    ) -> None:
        self.settings = settings
        self.store = runner.store
        self.runner = runner
        self.engine = engine
        self.validate_line = validate_line
        self.serves = serves  # whether a job's model is served here
        self.changes: dict[str, asyncio.Event] = {}
        runner.changed = self.changed

    def changed(self, job: Job) -> None:
        """Wake the job's watchers (the runner calls this on every change)."""
        event = self.changes.pop(job.job_id, None)
        if event is not None:
            event.set()

    async def create(self, request: CreateBatchCompletionRequest, owner: Owner) -> Job:
        found = Violations()
        check_job_request(request, self.engine, found)
        output = self.confined(request.output_data_path, "output_data_path", found)
        requests = await self.requests(request, found)
        if found.items:
            raise RequestValidationError(found.items)
        assert output is not None and requests is not None
        config = model_config_of(request)
        where = ("content",) if request.HasField("content") else ("input_data_path",)
        lines = checked_lines(
            requests, config.get("model"), where, self.settings, self.validate_line
        )
        job = self.new_job(request, owner, output, config, lines)
        await asyncio.to_thread(self.store.create, job, [line.body for line in lines])
        self.runner.start(job)
        return job

    def confined(self, given: str, field: str, found: Violations) -> str | None:
        return confined(self.settings.root, self.settings.buckets, given, field, found)

    async def requests(self, request: CreateBatchCompletionRequest, found: Violations) -> Any:
        has_file = request.HasField("input_data_path") and request.input_data_path
        has_content = request.HasField("content") and request.content.WhichOneof("kind") not in (
            None,
            "null_value",
        )
        if has_file == has_content:
            found.add((), "give input_data_path or content, one of them", "missing")
            return None
        if has_content:
            requests = requests_of(json_format.MessageToDict(request.content))
            if requests is None:
                found.add(("content",), "content is a list of completion or chat requests")
            return requests
        location = self.confined(request.input_data_path, "input_data_path", found)
        if location is None:
            return None
        try:
            return await asyncio.to_thread(
                read_input_file, location, self.settings, "input_data_path"
            )
        except RequestValidationError as error:
            for violation in error.violations:
                found.add(violation.loc, violation.msg, violation.type)
            return None

    def new_job(
        self,
        request: CreateBatchCompletionRequest,
        owner: Owner,
        output: str,
        config: dict[str, Any],
        lines: list[Line],
    ) -> Job:
        now = time.time()
        runtime = max_runtime_sec(request)
        return Job(
            job_id=f"batch-{uuid.uuid4().hex}",
            owner=owner.principal,
            tenant=owner.tenant,
            key_id=owner.key_id,
            status="queued",
            input_data_path=request.input_data_path
            if request.HasField("input_data_path")
            else None,
            output_data_path=request.output_data_path,
            output_file=output,
            model_config=config,
            priority=request.priority if request.HasField("priority") else None,
            labels=dict(request.labels),
            created_at=now,
            expires_at=now + runtime,
            max_runtime_sec=runtime,
            total=len(lines),
            kinds=[line.kind for line in lines],
            shards=max(1, min(data_parallelism(request), len(lines))),
        )

    def owned(self, job_id: str, owner: Owner) -> Job:
        job = self.store.load(job_id) if job_id.replace("-", "").isalnum() else None
        if job is None or job.owner != owner.principal:
            raise JobNotFoundError(job_id)
        return job

    def list(self, owner: Owner) -> list[Job]:
        jobs = [job for job in self.store.all() if job.owner == owner.principal]
        return sorted(jobs, key=lambda job: job.created_at, reverse=True)

    async def update(self, job_id: str, priority: str | None, owner: Owner) -> tuple[Job, bool]:
        job = self.owned(job_id, owner)
        if priority is None:
            return job, False
        await asyncio.to_thread(self.set_priority, job_id, priority)
        return self.owned(job_id, owner), True

    def set_priority(self, job_id: str, priority: str) -> None:
        with self.store.changing(job_id) as job:
            if job is not None:
                job.priority = priority

    async def cancel(self, job_id: str, owner: Owner) -> bool:
        """Cancel the job; once this returns, it reads as cancelled (unless it ended first)."""
        job = self.owned(job_id, owner)
        if job.terminal:
            return False
        self.store.ask_to_stop(job_id, CANCEL_MARKER)
        task = self.runner.stop(job_id, "cancelled")
        if task is not None:
            await asyncio.wait({task}, timeout=CANCEL_WAIT_SECONDS)
        await self.runner.end_if_idle(job_id)  # nobody runs it: it ends here
        # Else other processes run its shards, stop at the marker within a second, and end it.
        deadline = time.monotonic() + CANCEL_WAIT_SECONDS
        while time.monotonic() < deadline and not self.owned(job_id, owner).terminal:
            await asyncio.sleep(0.1)
        return True

    async def watch(self, job_id: str, owner: Owner) -> AsyncIterator[Job]:
        job = self.owned(job_id, owner)
        yield job
        while not job.terminal:
            event = self.changes.setdefault(job_id, asyncio.Event())
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(event.wait(), WATCH_POLL_SECONDS)
            latest = self.store.load(job_id)
            if latest is not None and latest != job:
                job = latest
                yield job

    def resume(self) -> int:
        """Start every unfinished job of a model served here that has a shard nobody runs (a
        new job's other shards, or a dead process's); how many were started."""
        started = 0
        for job in self.store.unfinished():
            if job.job_id in self.runner.tasks:
                continue
            if self.serves(str(job.model_config.get("model", ""))) and self.has_free_work(job):
                self.runner.start(job)
                started += 1
        return started

    def has_free_work(self, job: Job) -> bool:
        """Whether a shard with lines left is free, or every shard is (the job may be over,
        its output not written: its last process died on the way)."""
        free = [shard for shard in range(job.shards) if self.is_free(job, shard)]
        if len(free) == job.shards:
            return True
        lines_left = {shard: len(job.shard_lines(shard)) for shard in free}
        for shard in free:
            completed, failed = self.store.shard_counts(job.job_id, shard)
            if completed + failed < lines_left[shard]:
                return True
        return False

    def is_free(self, job: Job, shard: int) -> bool:
        with self.store.held(job.job_id, shard) as free:
            return free

    async def take_over(self) -> None:
        """Look, now and then, for shards nobody runs: another replica's new job's, or a dead
        process's (its locks go with it) on a root several replicas share."""
        while True:
            await asyncio.sleep(self.settings.takeover_seconds)
            if started := self.resume():
                logger.info("took up %d unfinished batch jobs", started)
