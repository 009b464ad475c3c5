"""bench.test_cpu: a test's CPU, its child processes' included, is charged to that test."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SPINNING_CHILD = """
import subprocess, sys

SPIN = "import time\\nend = time.process_time() + 2.5\\nwhile time.process_time() < end: pass"


def test_spins_in_a_child():
    subprocess.run([sys.executable, "-c", SPIN], check=True)


def test_idles():
    pass
"""


def test_a_childs_cpu_is_charged_to_the_test_that_ran_it(tmp_path: Path) -> None:
    (tmp_path / "test_spin.py").write_text(SPINNING_CHILD)
    report = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "bench.test_cpu", "-q", "test_spin.py"],
        cwd=tmp_path,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = {line.split()[-1]: line.split() for line in report.splitlines() if "::" in line}
    spun = float(rows["test_spin.py::test_spins_in_a_child"][0])
    idle = float(rows["test_spin.py::test_idles"][0])
    assert 1.5 <= spun <= 4.0, report  # its last half-second may be lost
    assert idle < 0.5, report
