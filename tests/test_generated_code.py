"""Generated code is rebuilt from the proto by one command and never drifts from it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GENERATED = [
    "clients/python/src/llmcompletions/v2/completions_pb2.py",
    "clients/python/src/llmcompletions/v2/completions_pb2.pyi",
    "clients/python/src/llmcompletions/v2/completions_pb2_grpc.py",
    "facade/completions.pb",
]


def test_generated_files_match_the_proto(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(REPO / "proto/generate.py"), "--out-root", str(tmp_path)], check=True
    )
    drifted = [
        name for name in GENERATED if (tmp_path / name).read_bytes() != (REPO / name).read_bytes()
    ]
    assert not drifted, f"regenerate with `make proto`: {drifted} differ from proto/"
