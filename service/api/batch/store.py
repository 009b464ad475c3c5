"""Where jobs live, on the replica's disk under the batch root: each job a directory with its
state (`job.json`, replaced atomically), its lines as taken at create (`lines.jsonl`), and the
durable record of its finished lines (`results.jsonl`, appended and synced about every second),
from which a restarted replica resumes it and its output file is written.

A job's runner holds an exclusive lock on its directory while it runs: another process of the
replica (another frontend, or the replica after a crash) takes only jobs nobody holds."""

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
# A file in a job's directory asking whichever process runs it to cancel it.
CANCEL_MARKER = "cancel"
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
    output_file: str  # output_data_path resolved inside the root
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

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Job:
        known = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in known})


def atomic_write(path: Path, text: str) -> None:
    """`text` at `path`, whole or not at all, synced."""
    with tempfile.NamedTemporaryFile(
        "w", dir=path.parent, prefix=f".{path.name}.", delete=False
    ) as scratch:
        scratch.write(text)
        scratch.flush()
        os.fsync(scratch.fileno())
    os.replace(scratch.name, path)


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

    def load(self, job_id: str) -> Job | None:
        try:
            return Job.from_dict(json.loads((self.directory(job_id) / "job.json").read_text()))
        except (OSError, ValueError, TypeError, AttributeError):  # none, or not a job's
            return None

    def all(self) -> list[Job]:
        found = (self.load(path.name) for path in sorted(self.jobs.iterdir()) if path.is_dir())
        return [job for job in found if job is not None]

    def lines(self, job_id: str) -> list[dict[str, Any]]:
        with (self.directory(job_id) / "lines.jsonl").open() as lines:
            return [json.loads(line) for line in lines]

    def results(self, job_id: str) -> dict[int, dict[str, Any]]:
        """The durable record: each finished line's result by index. A torn last line (a crash
        while it was written) is not a result: that line runs again."""
        found: dict[int, dict[str, Any]] = {}
        path = self.directory(job_id) / "results.jsonl"
        if not path.exists():
            return found
        for line in path.read_text().splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            found[int(entry["index"])] = entry["result"]
        return found

    def cancel_asked(self, job_id: str) -> bool:
        return (self.directory(job_id) / CANCEL_MARKER).exists()

    def open_record(self, job_id: str) -> TextIO:
        """The record, to append to: a torn last line (a crash) is ended first, so that the
        next result starts a line of its own."""
        path = self.directory(job_id) / "results.jsonl"
        record = path.open("a")
        if path.stat().st_size and not path.read_bytes().endswith(b"\n"):
            record.write("\n")
        return record

    @contextlib.contextmanager
    def held(self, job_id: str) -> Iterator[bool]:
        """Whether this process holds the job's lock (nobody else runs it), while inside."""
        with (self.directory(job_id) / "lock").open("a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            try:
                yield True
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


def record_line(record: TextIO, index: int, result: dict[str, Any]) -> None:
    record.write(json.dumps({"index": index, "result": result}) + "\n")


def sync(record: TextIO) -> None:
    record.flush()
    os.fsync(record.fileno())
