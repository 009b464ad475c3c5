"""The command line: every option documented with its default and environment variable."""

from __future__ import annotations

import re
import subprocess
import sys

from service import __version__


def run(*args: str, env: dict | None = None) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "service", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_help_lists_every_option_with_default_and_env() -> None:
    text = " ".join(run("serve", "--help").split())
    options = re.findall(r"^\s+(--[a-z-]+)", run("serve", "--help"), re.MULTILINE)
    assert len(options) >= 14
    for option in options:
        if option == "--help":
            continue
        described = text.split(option, 2)[-1].split(" --", 1)[0]
        assert "[env " in described and "default:" in described, option


def test_version() -> None:
    assert run("--version").strip().endswith(__version__)


def test_help_never_prints_the_api_key() -> None:
    import os

    text = run("serve", "--help", env={**os.environ, "API_KEY": "secret-key-xyz"})
    assert "secret-key-xyz" not in text


def test_an_unknown_event_loop_is_refused_with_the_choices() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "service", "serve", "--event-loop", "trio"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "must be one of: asyncio, uvloop" in done.stderr


def test_subcommands_are_listed() -> None:
    text = run("--help")
    assert "serve" in text and "prepare-model" in text
