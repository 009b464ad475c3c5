"""The layering holds (import-linter, over every import, those inside functions included):
service/'s layers import only downward (transport, then api, then model), the facade imports
nothing of service/ (it starts a replica as a program and reaches it over the wire), and
plumbing/ imports neither side. The contracts are in pyproject.toml."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_import_contract_is_kept() -> None:
    checked = subprocess.run(
        [str(Path(sys.executable).with_name("lint-imports")), "--no-cache"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "3 kept, 0 broken" in checked.stdout
