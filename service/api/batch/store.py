"""Where jobs live, under the batch root, which several replicas may share: each job a directory
with its state (`job.json`, replaced atomically), its lines as taken at create (`lines.jsonl`),
and for each of its shards (a job has `data_parallelism` of them: line i is in shard i mod n)
the durable record of its finished lines (`results-S.jsonl`, appended and synced about every
second) and their counts (`progress-S.json`). A restarted or surviving replica resumes a shard
from its record, and the output file is written from the records.

Locks decide who does what (flock: local disks, and NFS, CephFS, EFS): a shard's runner holds
its shard's lock while it runs, so that another process takes only shards nobody runs, and a
dead process's shards are free at once; the job's lock is held for a change of `job.json` and
while the job is finished (its output written)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, TextIO

JOBS_DIRECTORY = ".batch-jobs"
# Files in a job's directory asking whichever processes run its shards to stop it: a cancel, or
# a shard's failure (its text: why).
CANCEL_MARKER = "cancel"
FAILURE_MARKER = "failure"
# Beside a job that has ended: a scan for unfinished jobs passes it without reading it.
ENDED_MARKER = "ended"
TERMINAL = frozenset({"completed", "failed", "cancelled"})


@dataclass
class Job:
    """A job's state, as the API shows it and the store keeps it."""

    job_id: str
    owner: str  # the principal that created it: only it sees the job
    tenant: str
    key_id: str
    status: str  # queued, running, completed, failed, cancelled
    input_data_path: str | None
    output_data_path: str
    output_file: str  # output_data_path resolved: inside the root, or an allowed bucket's URL
    model_config: dict[str, Any]
    priority: str | None
    labels: dict[str, str]
    created_at: float
    expires_at: float
    max_runtime_sec: int
    total: int
    completed: int = 0
    failed: int = 0
    completed_at: float | None = None
    error: str | None = None  # why a failed job failed
    # Line kinds as run: "completion" or "chat" for each line (the input's order).
    kinds: list[str] = field(default_factory=list)
    shards: int = 1  # data_parallelism: how many processes may run its lines at once

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL

    def shard_lines(self, shard: int) -> range:
        return range(shard, self.total, self.shards)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Job:
        known = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in known})


def atomic_write(path: Path, text: str, durable: bool = True) -> None:
    """`text` at `path`, whole or not at all; synced unless not `durable`."""
    with tempfile.NamedTemporaryFile(
        "w", dir=path.parent, prefix=f".{path.name}.", delete=False
    ) as scratch:
        scratch.write(text)
        scratch.flush()
        if durable:
            os.fsync(scratch.fileno())
    os.replace(scratch.name, path)


@contextlib.contextmanager
def flocked(path: Path, wait: bool) -> Iterator[bool]:
    """Whether this process holds the lock at `path` (waiting for it if `wait`), while inside."""
    with path.open("a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


class JobStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.jobs = root / JOBS_DIRECTORY
        self.jobs.mkdir(parents=True, exist_ok=True)

    def directory(self, job_id: str) -> Path:
        return self.jobs / job_id

    def create(self, job: Job, lines: list[dict[str, Any]]) -> None:
        directory = self.directory(job.job_id)
        directory.mkdir()
        atomic_write(directory / "lines.jsonl", "".join(json.dumps(line) + "\n" for line in lines))
        self.save(job)

    def save(self, job: Job) -> None:
        atomic_write(self.directory(job.job_id) / "job.json", json.dumps(asdict(job)))
        if job.terminal:
            (self.directory(job.job_id) / ENDED_MARKER).touch()

    def load(self, job_id: str) -> Job | None:
        """The job, its counts those its shards have recorded so far while it runs."""
        try:
            job = Job.from_dict(json.loads((self.directory(job_id) / "job.json").read_text()))
        except (OSError, ValueError, TypeError, AttributeError):  # none, or not a job's
            return None
        if not job.terminal:
            job.completed, job.failed = self.counts(job)
        return job

    def all(self) -> list[Job]:
        found = (self.load(path.name) for path in sorted(self.jobs.iterdir()) if path.is_dir())
        return [job for job in found if job is not None]

    def unfinished(self) -> list[Job]:
        directories = sorted(self.jobs.iterdir())
        found = (
            self.load(path.name)
            for path in directories
            if path.is_dir() and not (path / ENDED_MARKER).exists()
        )
        return [job for job in found if job is not None and not job.terminal]

    @contextlib.contextmanager
    def changing(self, job_id: str) -> Iterator[Job | None]:
        """The job to change, under its lock (waited for): saved when the block leaves."""
        with flocked(self.directory(job_id) / "lock", wait=True):
            job = self.load(job_id)
            yield job
            if job is not None:
                self.save(job)

    def lines(self, job_id: str) -> list[dict[str, Any]]:
        with (self.directory(job_id) / "lines.jsonl").open() as lines:
            return [json.loads(line) for line in lines]

    def record_path(self, job_id: str, shard: int) -> Path:
        return self.directory(job_id) / f"results-{shard}.jsonl"

    def results(self, job: Job, shards: range | None = None) -> dict[int, dict[str, Any]]:
        """The durable records (of every shard, or of those named): each finished line's result
        by index. A torn last line (a crash while it was written) is not a result: that line
        runs again."""
        found: dict[int, dict[str, Any]] = {}
        for shard in shards if shards is not None else range(job.shards):
            path = self.record_path(job.job_id, shard)
            if not path.exists():
                continue
            for line in path.read_text().splitlines():
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue
                found[int(entry["index"])] = entry["result"]
        return found

    def open_record(self, job_id: str, shard: int) -> TextIO:
        """A shard's record, to append to: a torn last line (a crash) is ended first, so that
        the next result starts a line of its own."""
        path = self.record_path(job_id, shard)
        record = path.open("a")
        if path.stat().st_size and not path.read_bytes().endswith(b"\n"):
            record.write("\n")
        return record

    def save_progress(self, job_id: str, shard: int, completed: int, failed: int) -> None:
        """A shard's counts, for readers of the job (the record stays the truth: not synced)."""
        progress = json.dumps({"completed": completed, "failed": failed})
        atomic_write(self.directory(job_id) / f"progress-{shard}.json", progress, durable=False)

    def shard_counts(self, job_id: str, shard: int) -> tuple[int, int]:
        """A shard's lines completed and failed, as its runner last said."""
        try:
            progress = json.loads((self.directory(job_id) / f"progress-{shard}.json").read_text())
            return int(progress["completed"]), int(progress["failed"])
        except (OSError, ValueError, KeyError, TypeError):
            return 0, 0

    def counts(self, job: Job) -> tuple[int, int]:
        shards = [self.shard_counts(job.job_id, shard) for shard in range(job.shards)]
        return sum(completed for completed, _ in shards), sum(failed for _, failed in shards)

    def ask_to_stop(self, job_id: str, marker: str, why: str = "") -> None:
        (self.directory(job_id) / marker).write_text(why)

    def stop_asked(self, job_id: str) -> str | None:
        """Why the job's shards should stop: "cancelled" or "failed", or None."""
        directory = self.directory(job_id)
        if (directory / CANCEL_MARKER).exists():
            return "cancelled"
        return "failed" if (directory / FAILURE_MARKER).exists() else None

    def failure(self, job_id: str) -> str | None:
        try:
            return (self.directory(job_id) / FAILURE_MARKER).read_text() or "a shard failed"
        except OSError:
            return None

    def held(self, job_id: str, shard: int) -> contextlib.AbstractContextManager[bool]:
        """Whether this process holds the shard's lock (nobody else runs it), while inside."""
        return flocked(self.directory(job_id) / f"lock-{shard}", wait=False)

    @contextlib.contextmanager
    def idle(self, job: Job) -> Iterator[bool]:
        """Whether no process runs any of the job's shards (their locks, all held while inside,
        keep it so), with the job's lock held (waited for)."""
        with contextlib.ExitStack() as locks:
            locks.enter_context(flocked(self.directory(job.job_id) / "lock", wait=True))
            for shard in range(job.shards):
                if not locks.enter_context(self.held(job.job_id, shard)):
                    yield False
                    return
            yield True


def record_line(record: TextIO, index: int, result: dict[str, Any]) -> None:
    record.write(json.dumps({"index": index, "result": result}) + "\n")


def sync(record: TextIO) -> None:
    record.flush()
    os.fsync(record.fileno())
