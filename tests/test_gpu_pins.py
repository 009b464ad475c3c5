"""requirements/constraints-gpu.txt resolved again: pip's resolver, for the GPU image's Python
and platform, under the file's own pins, must want exactly the pinned set.

Metadata only (requirements/lock.py): no wheel is installed or downloaded, so this runs on a
machine without a GPU or CUDA. It needs the package index (about 80 s with 2 cores: pip reads
some 230 wheels' metadata one by one, mostly waiting on the network) and a CPython of the
image's version (pip evaluates environment markers with the interpreter it runs on); without
either it is skipped. The resolver runs in the background from the session's start
(`background`, started by tests/conftest.py), so that its wait overlaps the other tests.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from requirements import lock


def background() -> lock.Resolution | str:
    """The resolution of the GPU pins, or why it cannot be had here."""
    python = lock.find_python()
    if python is None:
        return f"no CPython {lock.PYTHON_VERSION} here (LOCK_PYTHON names one)"
    with tempfile.TemporaryDirectory(prefix="gpu-pins-") as scratch:
        try:
            return lock.resolve(lock.GPU_PINS, python, Path(scratch) / "report.json")
        except lock.RegistryUnreachable as unreachable:
            return f"the package index is unreachable: {unreachable}"


def test_the_resolver_wants_exactly_the_gpu_pins(background_result: object) -> None:
    if isinstance(background_result, str):
        pytest.skip(background_result)
    assert isinstance(background_result, lock.Resolution)
    resolution = background_result
    pinned = {n: v for n, v in lock.read_pins(lock.GPU_PINS).items() if n not in lock.SOURCE_ONLY}
    resolved = {name: version for name, (_, version) in resolution.pins.items()}
    assert sorted(set(resolved) - set(pinned)) == [], "resolved but not pinned"
    assert sorted(set(pinned) - set(resolved)) == [], "pinned but not needed"
    different = {n: (pinned[n], v) for n, v in resolved.items() if n in pinned and pinned[n] != v}
    assert different == {}, "pinned version, resolved version"
    # Metadata only: pip says "Downloading <file>" for each file it fetches whole.
    assert "Downloading " not in resolution.log
