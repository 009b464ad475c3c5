"""Runs a job's shards (line i is in shard i mod the job's data_parallelism): each process of
every replica on the root takes one free shard of a job at a time, and runs the lines its
durable record does not hold yet, in input order, each through the synchronous call path
(`LineCaller`), at most a window of them in flight in the process. Each finished line goes into
the shard's record at once (synced about every second). When no process runs any of its shards
any more and the job has ended (every line done, cancelled, expired, failed), whoever released
the last shard writes its output file from the records, the lines that did not run marked as
such. A line the caller's limits or a busy engine hold back waits and runs again; any other
refusal is that line's error, and the job goes on."""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TextIO

from service.api.batch.output import write_output
from service.api.batch.store import FAILURE_MARKER, Job, JobStore, record_line, sync

logger = logging.getLogger(__name__)

SYNC_SECONDS = 1.0
# While interactive calls run, at most this share of the window of lines stays in flight (the
# newest lines beyond it are stopped and queued again) ...
YIELDING_SHARE = 32
# ... checked this often, and for this long after the last one was seen (a client's next call
# comes soon: lines started in between would be in its steps).
YIELD_CHECK_SECONDS = 0.05
INTERACTIVE_HOLD_SECONDS = 2.0


@dataclass(frozen=True)
class Owner:
    """Whose call a line is: the job's creator."""

    principal: str
    tenant: str
    key_id: str


class RetryLaterError(Exception):
    """The line was held back (the caller's rate limit, a busy or loading engine): run it
    again after `seconds`."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"retry in {seconds:g} s")
        self.seconds = seconds


class LineCaller(Protocol):
    async def __call__(self, kind: str, body: dict[str, Any], owner: Owner) -> dict[str, Any]:
        """The line's result: {"response": body} or {"error": {"status_code", "detail"}};
        raises RetryLaterError."""
        ...


class BatchCounts(Protocol):
    """Where finished lines and ended jobs are counted (the metrics)."""

    def line_finished(self, result: str) -> None:
        """A line "completed" or "failed"."""

    def job_ended(self, status: str) -> None: ...


class Uncounted:
    def line_finished(self, result: str) -> None:
        pass

    def job_ended(self, status: str) -> None:
        pass


class Runner:
    """Runs jobs, each in a task of its own. Interactive calls go first: when one comes, the
    newest lines beyond a 32nd of the window are stopped (their engine requests aborted)
    and queued again, and while interactive calls run (and for a moment after) no more start:
    each line in a decoding step makes the step, and so every call in it, dearer."""

    def __init__(
        self,
        store: JobStore,
        call_line: LineCaller,
        window: int,
        counts: BatchCounts | None = None,
        interactive_calls: Callable[[], int] = lambda: 0,
    ) -> None:
        self.store = store
        self.call_line = call_line
        self.window = window
        self.slots: asyncio.Semaphore | None = None  # the window, made in the running loop
        self.yielding_window = max(1, window // YIELDING_SHARE)
        self.interactive_calls = interactive_calls  # this process's calls that are no lines
        self.lines_in_flight = 0  # of every job this process runs
        self.line_tasks: dict[asyncio.Task[None], None] = {}  # those in flight, oldest first
        self.preempted: set[asyncio.Task[None]] = set()  # stopped for interactive calls
        self.interactive_seen_at = float("-inf")
        self.counts = counts or Uncounted()
        self.changed: Callable[[Job], None] = lambda job: None  # told of every change
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.stops: dict[str, str] = {}

    def start(self, job: Job) -> None:
        if job.job_id not in self.tasks:
            task = asyncio.create_task(self.run(job.job_id), name=f"batch-{job.job_id}")
            self.tasks[job.job_id] = task
            task.add_done_callback(lambda _: self.ended(job.job_id))

    def ended(self, job_id: str) -> None:
        self.tasks.pop(job_id, None)
        self.stops.pop(job_id, None)

    def stop(self, job_id: str, reason: str) -> asyncio.Task[None] | None:
        """Stop this process's run of a job: "cancelled", "expired", "failed" (another shard
        failed), or "shutdown" (the replica stops: the job stays unfinished, to resume). Its
        task, if this process was running the job."""
        task = self.tasks.get(job_id)
        if task is not None:
            self.stops[job_id] = reason
            task.cancel()
        return task

    async def stop_all(self) -> None:
        tasks = list(self.tasks.values())
        for job_id in list(self.tasks):
            self.stop(job_id, "shutdown")
        await asyncio.gather(*tasks, return_exceptions=True)

    async def run(self, job_id: str) -> None:
        """Run each of the job's shards that nobody else runs, one after another; then end the
        job if it has ended and no process runs it any more."""
        job = self.store.load(job_id)
        for shard in range(job.shards if job is not None else 0):
            with self.store.held(job_id, shard) as mine:
                fresh = self.store.load(job_id)
                if not mine or fresh is None or fresh.terminal:
                    continue
                if not await self.run_shard(fresh, shard):
                    break  # stopped: cancelled, expired, failed
        await self.end_if_idle(job_id)

    async def run_shard(self, job: Job, shard: int) -> bool:
        """Run the shard's unrecorded lines; whether they all ran (else the job was stopped)."""
        shard_range = range(shard, shard + 1)
        results = self.store.results(job, shard_range)
        pending = [index for index in job.shard_lines(shard) if index not in results]
        if not pending or self.store.stop_asked(job.job_id):
            return not pending
        await asyncio.to_thread(self.mark_running, job.job_id)
        counts = ShardCounts(job, shard, results)
        counts.save(self.store)
        lines = self.store.lines(job.job_id)
        owner = Owner(job.owner, job.tenant, job.key_id)
        deadline = asyncio.get_running_loop().call_later(
            max(0.0, job.expires_at - time.time()), self.stop, job.job_id, "expired"
        )
        with self.store.open_record(job.job_id, shard) as record:
            syncing = asyncio.create_task(self.sync_every_second(record, job, counts))
            try:
                await self.run_lines(job, lines, pending, owner, record, counts)
                return True
            except asyncio.CancelledError:
                if self.stops.pop(job.job_id, "shutdown") == "shutdown":
                    raise
                return False
            except Exception as error:
                logger.exception("batch job %s failed", job.job_id)
                why = f"{type(error).__name__}: {error}"
                self.store.ask_to_stop(job.job_id, FAILURE_MARKER, why)
                return False
            finally:
                deadline.cancel()
                syncing.cancel()
                sync(record)
                counts.save(self.store)

    def mark_running(self, job_id: str) -> None:
        with self.store.changing(job_id) as job:
            if job is not None and job.status == "queued":
                job.status = "running"

    async def run_lines(
        self,
        job: Job,
        lines: list[dict[str, Any]],
        pending: list[int],
        owner: Owner,
        record: TextIO,
        counts: ShardCounts,
    ) -> None:
        if self.slots is None:
            self.slots = asyncio.Semaphore(self.window)
        window = self.slots
        queue = collections.deque(pending)
        in_flight: set[asyncio.Task[None]] = set()
        watching = asyncio.create_task(self.watch_interactive_calls())

        async def one(index: int) -> None:
            try:
                result = await self.until_run(job.kinds[index], lines[index], owner)
            except Exception as error:
                logger.exception("batch job %s: line %d failed", job.job_id, index)
                detail = f"the line failed on the server: {type(error).__name__}"
                result = {"error": {"status_code": 500, "detail": detail}}
            record_line(record, index, result)
            counts.add(result)
            self.counts.line_finished("completed" if "response" in result else "failed")

        def ended(task: asyncio.Task[None], index: int) -> None:
            """A line's end (a task cancelled before it ran, too): its place in the window
            freed; if stopped for interactive calls, queued again, first."""
            self.lines_in_flight -= 1
            self.line_tasks.pop(task, None)
            in_flight.discard(task)
            window.release()
            if task in self.preempted:
                self.preempted.discard(task)
                if task.cancelled():
                    queue.appendleft(index)

        try:
            while queue or in_flight:
                if not queue:  # a preempted line may come back
                    await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
                    continue
                await window.acquire()
                await self.yield_to_interactive_calls()
                if not queue:
                    window.release()
                    continue
                self.lines_in_flight += 1  # from now: its task may not have run yet
                index = queue.popleft()
                task = asyncio.create_task(one(index))
                self.line_tasks[task] = None
                in_flight.add(task)
                task.add_done_callback(functools.partial(ended, index=index))
        finally:
            watching.cancel()
            for task in in_flight:
                task.cancel()
            await asyncio.gather(*in_flight, return_exceptions=True)

    async def yield_to_interactive_calls(self) -> None:
        """Wait while interactive calls ran lately and the lines in flight are over the
        yielding window: each line in a decoding step makes the step, and so every call in
        it, dearer."""
        while self.lines_in_flight >= self.yielding_window and self.interactive_lately():
            await asyncio.sleep(YIELD_CHECK_SECONDS)

    def interactive_lately(self) -> bool:
        self.look_for_interactive_calls()
        return time.monotonic() - self.interactive_seen_at < INTERACTIVE_HOLD_SECONDS

    def look_for_interactive_calls(self) -> None:
        if self.interactive_calls() > 0:
            self.interactive_seen_at = time.monotonic()
            self.preempt_beyond_yielding_window()

    def preempt_beyond_yielding_window(self) -> None:
        """Stop the newest lines beyond the yielding window (the least work lost); each goes
        back to its queue."""
        running = [task for task in self.line_tasks if task not in self.preempted]
        for task in running[self.yielding_window :]:
            self.preempted.add(task)
            task.cancel()

    async def watch_interactive_calls(self) -> None:
        while True:
            self.look_for_interactive_calls()
            await asyncio.sleep(YIELD_CHECK_SECONDS)

    async def until_run(self, kind: str, body: dict[str, Any], owner: Owner) -> dict[str, Any]:
        while True:
            try:
                return await self.call_line(kind, body, owner)
            except RetryLaterError as held_back:
                await asyncio.sleep(held_back.seconds)

    async def sync_every_second(self, record: TextIO, job: Job, counts: ShardCounts) -> None:
        """Sync the record and publish the shard's counts (a file each: once a second, not a
        line, on a shared volume); stop the job if another process asked to (a cancel, a
        failure)."""
        while True:
            await asyncio.sleep(SYNC_SECONDS)
            sync(record)
            counts.save(self.store)
            self.changed(job)
            if reason := self.store.stop_asked(job.job_id):
                self.stop(job.job_id, reason)

    async def end_if_idle(self, job_id: str) -> Job | None:
        """End the job if it has ended and no process runs any of its shards: its output
        written, its status final. The job, if it was ended here."""
        job = await asyncio.to_thread(self.closed_if_idle, job_id)
        if job is not None:
            self.changed(job)
            self.counts.job_ended(job.status)
        return job

    def closed_if_idle(self, job_id: str) -> Job | None:
        job = self.store.load(job_id)
        if job is None or job.terminal:
            return None
        with self.store.idle(job) as idle:
            fresh = self.store.load(job_id) if idle else None
            if fresh is None or fresh.terminal:
                return None
            results = self.store.results(fresh)
            ended = self.ending(fresh, results)
            if ended is not None:
                self.close(fresh, ended, results)
                return fresh
        return None

    def ending(self, job: Job, results: dict[int, dict[str, Any]]) -> str | None:
        """How the job ended: "completed", "cancelled", "failed", "expired"; None while it has
        lines to run (its runs were stopped with their replica: it resumes)."""
        if len(results) == job.total:
            return "completed"
        if stopped := self.store.stop_asked(job.job_id):
            return stopped
        return "expired" if time.time() >= job.expires_at else None

    def close(self, job: Job, ended: str, results: dict[int, dict[str, Any]]) -> None:
        job.status = "failed" if ended == "expired" else ended
        if ended == "expired":
            job.error = f"max_runtime_sec ({job.max_runtime_sec}) passed before every line ran"
        elif ended == "failed":
            job.error = self.store.failure(job.job_id)
        job.completed = sum("response" in result for result in results.values())
        job.failed = len(results) - job.completed
        job.completed_at = time.time()
        try:
            write_output(job, results, ended)
        except OSError as error:
            job.status, job.error = "failed", f"the output file could not be written: {error}"
        self.store.save(job)


class ShardCounts:
    """The lines of one shard done so far, for the job's readers."""

    def __init__(self, job: Job, shard: int, results: dict[int, dict[str, Any]]) -> None:
        self.job, self.shard = job, shard
        self.completed: int = sum("response" in result for result in results.values())
        self.failed: int = len(results) - self.completed

    def add(self, result: dict[str, Any]) -> None:
        if "response" in result:
            self.completed += 1
        else:
            self.failed += 1

    def save(self, store: JobStore) -> None:
        store.save_progress(self.job.job_id, self.shard, self.completed, self.failed)
