"""The launcher that ties the engine's processes to the server from their first instant
(service/model/lifetime.py): a process multiprocessing starts through it dies with its parent,
even while it is still starting, and multiprocessing's resource tracker is left to exit by
itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# A server stand-in: ties the processes it spawns, starts one that would sleep a minute, prints
# its pid and waits to be killed.
PARENT = """
import multiprocessing, pathlib, sys, time
from service.model.lifetime import mark_engine_parent
mark_engine_parent(pathlib.Path(sys.argv[1]))
child = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,))
child.start()
print(child.pid, flush=True)
time.sleep(60)
"""

GONE_WITHIN_SECONDS = 5.0


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_spawned_process_dies_with_its_killed_parent(tmp_path: Path) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert running(child)
        launcher = (tmp_path / "engine-python").read_text()
        assert launcher.startswith(f"#!{sys.executable}")
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + GONE_WITHIN_SECONDS
        while running(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not running(child), "the spawned process outlived its killed parent"
    finally:
        parent.kill()
        parent.wait()


def test_the_launcher_runs_python_with_the_arguments_it_is_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import multiprocessing

    from service.model.lifetime import (
        ENGINE_PARENT_ENV,
        LAUNCHER_ENV,
        SPAWNER_ENV,
        mark_engine_parent,
    )

    for key in (ENGINE_PARENT_ENV, LAUNCHER_ENV, SPAWNER_ENV):
        monkeypatch.delenv(key, raising=False)  # restored after the test
    try:
        mark_engine_parent(tmp_path)
        launcher = os.environ[LAUNCHER_ENV]
        out = subprocess.run(
            [launcher, "-c", "import sys; print(sys.executable, sys.argv[1:])", "a", "b c"],
            capture_output=True,
            text=True,
            check=True,
        )
        assert out.stdout.strip() == f"{sys.executable} ['a', 'b c']"
    finally:
        multiprocessing.set_executable(sys.executable)
