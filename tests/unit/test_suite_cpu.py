"""bench.suite_cpu: processes sorted into kinds, and a command's CPU found by sampling."""

from __future__ import annotations

import sys

import pytest

from bench.suite_cpu import kind_of, main


@pytest.mark.parametrize(
    ("comm", "command", "kind"),
    [
        ("VLLM::Worker", "VLLM::Worker", "engine worker"),
        ("VLLM::EngineCor", "VLLM::EngineCore", "engine core"),
        ("VLLM::Frontend_", "VLLM::Frontend_1", "our frontend processes"),
        (
            "python",
            "python -B -c from multiprocessing.spawn import spawn_main",
            "engine process, importing",
        ),
        (
            "python",
            "/x/.venv/bin/python -m service serve --port 1",
            "our server (and its frontends)",
        ),
        ("python", "python -m vllm.entrypoints.openai.api_server", "vLLM's own server"),
        ("envoy", "envoy -c /tmp/e.yaml", "Envoy"),
        ("python", "python -m facade.picker.server --listen 127.0.0.1:1", "replica picker"),
        ("sh", "sh image/install.sh", "other (sh)"),
    ],
)
def test_a_process_is_counted_under_its_kind(comm: str, command: str, kind: str) -> None:
    assert kind_of(comm, command) == kind


def test_the_commands_cpu_is_found_and_its_exit_code_kept(
    capsys: pytest.CaptureFixture[str],
) -> None:
    spin = "import time\nend = time.process_time() + 1.5\nwhile time.process_time() < end: pass"
    code = main(["--interval", "0.1", "--", sys.executable, "-c", spin + "\nraise SystemExit(3)"])
    assert code == 3
    report = capsys.readouterr().out
    seconds = int(report.splitlines()[1].split()[0])
    assert 1 <= seconds <= 2, report
