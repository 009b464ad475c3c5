"""The command line: every option documented with its default and environment variable."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

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
    # An entry runs from one option (argparse indents them two spaces) to the next, so help that
    # names another flag (say, "needs --tool-call-parser") stays in its own entry.
    entries = re.split(r"^  (?=--[a-z-]+)", run("serve", "--help"), flags=re.MULTILINE)[1:]
    described = {entry.split()[0].rstrip(","): " ".join(entry.split()) for entry in entries}
    assert len(described) >= 14
    for option, text in described.items():
        if option == "--help":
            continue
        assert "[env " in text and "default:" in text, option


def test_version() -> None:
    assert run("--version").strip().endswith(__version__)


def test_help_never_prints_the_api_key() -> None:
    text = run("serve", "--help", env={**os.environ, "API_KEY": "secret-key-xyz"})
    assert "secret-key-xyz" not in text


@pytest.mark.parametrize(
    ("args", "env"), [(["--log-format", "xml"], {}), ([], {"LOG_FORMAT": "xml"})]
)
def test_an_unknown_log_format_is_refused_with_the_choices(
    args: list[str], env: dict[str, str]
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "service", *args, "serve"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )
    assert done.returncode == 2
    assert "argument --log-format: must be one of: plain, json" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("args", "env"), [(["--log-level", "verbose"], {}), ([], {"LOG_LEVEL": "verbose"})]
)
def test_an_unknown_log_level_is_refused_with_the_choices(
    args: list[str], env: dict[str, str]
) -> None:
    # No explicit command: `serve` is implied after the top-level options.
    done = subprocess.run(
        [sys.executable, "-m", "service", *args, "--port", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )
    assert done.returncode == 2
    assert "argument --log-level: must be one of: DEBUG, INFO, WARNING, ERROR, CRITICAL" in (
        done.stderr
    )
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"ENVOY_CONCURRENCY": "abc"}, "argument --concurrency"),
        ({"ENVOY_CONCURRENCY": "0"}, "must be at least 1"),
        ({"HTTP_PORT": "http"}, "argument --http-port"),
        ({"GRPC_PORT": "grpc"}, "GRPC_PORT: expected HOST:PORT"),
    ],
)
def test_envoy_launcher_refuses_bad_environment_with_a_usage_error(
    env: dict[str, str], message: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "facade.launch"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
    )
    assert done.returncode == 2
    assert message in done.stderr and "Traceback" not in done.stderr


def test_subcommands_are_listed() -> None:
    text = run("--help")
    assert "serve" in text and "prepare-model" in text
