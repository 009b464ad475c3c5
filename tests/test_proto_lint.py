"""The proto passes buf's STANDARD and COMMENTS lint rules, so other languages' callers can
generate clean code from it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BUF = shutil.which("buf") or str(Path(sys.executable).parent / "buf")


def test_buf_lint_passes() -> None:
    done = subprocess.run(
        [
            BUF,
            "lint",
            "../facade/completions.pb#format=binpb",
            "--path",
            "llmcompletions/v2/completions.proto",
        ],
        cwd=REPO / "proto",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
