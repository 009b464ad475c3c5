"""Summaries of py-spy's collapsed stacks: CPU share by library, and the top functions."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

# A frame's library, by the first of these fragments the frame ("function (file:line)") holds.
LIBRARIES = (
    ("service/", "our service (service/)"),
    # A leaf here is native code run from the loop: grpc aio's Cython core, C-level tasks.
    ("Handle._run (", "native code in event-loop callbacks (grpc aio's Cython core)"),
    ("selectors.py", "epoll wait"),
    ("copy.py", "copy.deepcopy (vLLM's tokenizer pool)"),
    ("concurrent/futures", "thread pools"),
    ("threading.py", "thread pools"),
    ("llmcompletions/", "our generated stubs"),
    ("grpc", "grpc (aio, cython)"),
    ("google/protobuf", "protobuf"),
    ("prometheus_client", "prometheus_client"),
    ("vllm/", "vLLM (output processing, detokenizer, engine client)"),
    ("tokenizers", "tokenizers"),
    ("transformers", "tokenizers"),
    ("uvloop", "event loop"),
    ("asyncio/", "event loop"),
    ("zmq", "zmq (engine IPC)"),
    ("msgspec", "msgspec (engine IPC)"),
)


def library(frame: str) -> str:
    return next((label for fragment, label in LIBRARIES if fragment in frame), "other")


def parse(path: Path) -> list[tuple[list[str], int]]:
    """(frames from the outermost, sample count) per collapsed-stack line."""
    stacks = []
    for line in path.read_text().splitlines():
        frames, _, count = line.rpartition(" ")
        if frames and count.isdigit():
            stacks.append((frames.split(";"), int(count)))
    return stacks


def summarize_stacks(path: Path, top: int = 12) -> dict[str, Any]:
    """Self-time share by library (a sample counts for the library of its innermost frame),
    and inclusive shares of the busiest functions of our own code."""
    stacks = parse(path)
    total = sum(count for _, count in stacks) or 1
    by_library: Counter[str] = Counter()
    ours: Counter[str] = Counter()
    for frames, count in stacks:
        by_library[library(frames[-1])] += count
        for frame in set(frames):
            if library(frame) == LIBRARIES[0][1]:
                ours[frame] += count
    return {
        "samples": total,
        "groups": [(name, n / total) for name, n in by_library.most_common()],
        "top": [(frame, n / total) for frame, n in ours.most_common(top)],
    }
