"""service/cli.py and service/settings.py: defaults, environment variables, flags over
environment, bad values refused with a usage error (exit 2), and the settings `serve` gets."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from service import __version__, cli
from service.api.declared_ranges import ENGINE_MAX_LOGPROBS, MAX_BEST_OF
from service.model.adapters import ModelCatalog
from service.model.default_model import DEFAULT_SERVED_MODEL_NAME
from service.model.engine import engine_args
from service.settings import (
    EngineSettings,
    KeepaliveSettings,
    LoraModule,
    RequestLimits,
    ServerSettings,
    TlsSettings,
)
from tests.certificates import CertificateAuthority

MIB = 1024 * 1024


def env_names() -> set[str]:
    """Every environment variable the command line reads, from its help texts."""
    names: set[str] = set()
    parsers = [cli.build_parser()]
    while parsers:
        parser = parsers.pop()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                parsers.extend(action.choices.values())
            names.update(re.findall(r"\[env (\w+)", action.help or ""))
    return names


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No option comes from the environment unless a test sets it (make exports GRPC_PORT)."""
    for name in env_names():
        monkeypatch.delenv(name, raising=False)
    yield


def parse(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(list(argv))


def usage_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as caught:
        parse(*argv)
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: llm-completions")
    return err


def test_the_environment_names_are_the_documented_ones() -> None:
    assert {
        "GRPC_HOST",
        "GRPC_PORT",
        "MODEL",
        "SERVED_MODEL_NAME",
        "API_KEY",
        "MAX_NUM_SEQS",
        "MAX_NUM_QUEUED_REQS",
        "MAX_NUM_QUEUED_TOKENS",
        "MAX_MESSAGE_BYTES",
        "LOG_LEVEL",
        "LOG_FORMAT",
        "LOG_PROMPTS",
        "DRAIN_DELAY_SECONDS",
        "ENGINE_ARGS",
        "LORA_MODULES",
        "MAX_LORAS",
        "MAX_LORA_RANK",
    } <= env_names()


# The documented defaults (docs/operating/configuration.md) as `serve` parses them.
DOCUMENTED_DEFAULTS: dict[str, Any] = {
    "log_level": "INFO",
    "log_format": "plain",
    "command": "serve",
    "host": "127.0.0.1",
    "port": 50051,
    "api_key": None,
    "operator_api_key": None,
    "adapter_root": None,
    "enable_adapter_loading": False,
    "max_cpu_loras": None,
    "max_adapters": 64,
    "max_adapter_bytes": 1024**3,
    "adapter_drain_seconds": 30.0,
    "metrics_host": "127.0.0.1",
    "metrics_port": 9400,
    "log_prompts": False,
    "max_num_seqs": None,
    "max_num_queued_reqs": None,
    "max_num_queued_tokens": None,
    "max_prompts": 64,
    "max_choices": 256,
    "max_prompt_tokens": 65536,
    "max_constraint_bytes": 65536,
    "max_logit_bias": 1024,
    "max_message_bytes": 16 * MIB,
    "drain_delay": 0.0,
    "shutdown_grace": 30.0,
    "model": None,
    "served_model_name": None,
    "dtype": "auto",
    "max_model_len": None,
    "kv_cache_gib": None,
    "structured_outputs_backend": "xgrammar",
    "tensor_parallel_size": 1,
    "pipeline_parallel_size": 1,
    "data_parallel_size": 1,
    "distributed_executor_backend": None,
    "engine_args": {},
    "lora_modules": (),
    "max_loras": 1,
    "max_lora_rank": 16,
    "lora_target_modules": None,
}


def test_defaults() -> None:
    args = parse("serve")
    # Options may be added or retired: the documented ones are checked, not the whole namespace.
    assert {name: getattr(args, name) for name in DOCUMENTED_DEFAULTS} == DOCUMENTED_DEFAULTS


def test_the_limit_defaults_are_request_limits_defaults() -> None:
    args = parse("serve")
    limits = RequestLimits()
    assert (args.max_prompts, args.max_choices, args.max_prompt_tokens) == (
        limits.max_prompts,
        limits.max_choices,
        limits.max_prompt_tokens,
    )
    assert (args.max_constraint_bytes, args.max_logit_bias) == (
        limits.max_constraint_bytes,
        limits.max_logit_bias,
    )


@pytest.mark.parametrize(
    ("env", "attribute", "expected"),
    [
        ({"GRPC_HOST": "0.0.0.0"}, "host", "0.0.0.0"),
        ({"GRPC_PORT": "6000"}, "port", 6000),
        ({"MODEL": "/models/my-llama"}, "model", Path("/models/my-llama")),
        ({"SERVED_MODEL_NAME": "llama"}, "served_model_name", "llama"),
        ({"MAX_MODEL_LEN": "512"}, "max_model_len", 512),
        ({"KV_CACHE_GIB": "0.25"}, "kv_cache_gib", 0.25),
        ({"TENSOR_PARALLEL_SIZE": "2"}, "tensor_parallel_size", 2),
        ({"DISTRIBUTED_EXECUTOR_BACKEND": "ray"}, "distributed_executor_backend", "ray"),
        ({"ENGINE_ARGS": '{"max_num_seqs": 4}'}, "engine_args", {"max_num_seqs": 4}),
        (
            {"LORA_MODULES": "sql=/adapters/sql, chat=/adapters/chat"},
            "lora_modules",
            (LoraModule("sql", Path("/adapters/sql")), LoraModule("chat", Path("/adapters/chat"))),
        ),
        ({"MAX_LORAS": "3"}, "max_loras", 3),
        ({"MAX_LORA_RANK": "64"}, "max_lora_rank", 64),
        ({"LORA_TARGET_MODULES": "q_proj, v_proj"}, "lora_target_modules", ("q_proj", "v_proj")),
        ({"API_KEY": "k-123"}, "api_key", "k-123"),
        ({"METRICS_PORT": "9500"}, "metrics_port", 9500),
        ({"MAX_NUM_SEQS": "4"}, "max_num_seqs", 4),
        ({"MAX_NUM_QUEUED_REQS": "40"}, "max_num_queued_reqs", 40),
        ({"MAX_NUM_QUEUED_TOKENS": "4096"}, "max_num_queued_tokens", 4096),
        ({"MAX_PROMPTS": "8"}, "max_prompts", 8),
        ({"MAX_MESSAGE_BYTES": "1024"}, "max_message_bytes", 1024),
        ({"DRAIN_DELAY_SECONDS": "5"}, "drain_delay", 5.0),
        ({"SHUTDOWN_GRACE_SECONDS": "2.5"}, "shutdown_grace", 2.5),
        ({"GRPC_PORT": ""}, "port", 50051),  # empty means unset
    ],
)
def test_environment_variables_set_options(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], attribute: str, expected: Any
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert getattr(parse("serve"), attribute) == expected


def test_top_level_options_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOG_LEVEL", "debug")
    monkeypatch.setenv("LOG_FORMAT", "json")
    args = parse("serve")
    assert (args.log_level, args.log_format) == ("debug", "json")


@pytest.mark.parametrize(
    ("value", "enabled"),
    [("1", True), ("true", True), ("YES", True), ("on", True), ("0", False), ("", False)],
)
def test_switches_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, value: str, enabled: bool
) -> None:
    monkeypatch.setenv("LOG_PROMPTS", value)
    assert parse("serve").log_prompts is enabled
    assert parse("serve", "--log-prompts").log_prompts is True


def test_flags_win_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRPC_PORT", "6000")
    monkeypatch.setenv("KV_CACHE_GIB", "not-a-number")  # never converted: the flag wins
    monkeypatch.setenv("ENGINE_ARGS", "[1]")
    args = parse("serve", "--port", "7000", "--kv-cache-gib", "1.5", "--engine-args", "{}")
    assert (args.port, args.kv_cache_gib, args.engine_args) == (7000, 1.5, {})


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"GRPC_PORT": "grpc"}, "argument --port: invalid int value: 'grpc'"),
        ({"METRICS_PORT": "9400.5"}, "argument --metrics-port: invalid int value"),
        ({"MAX_NUM_QUEUED_REQS": "many"}, "argument --max-num-queued-reqs: invalid int value"),
        ({"KV_CACHE_GIB": "lots"}, "argument --kv-cache-gib: invalid float value: 'lots'"),
        ({"DRAIN_DELAY_SECONDS": "5s"}, "argument --drain-delay: invalid float value"),
        ({"ENGINE_ARGS": "[1]"}, "argument --engine-args: must be a JSON object"),
        ({"ENGINE_ARGS": "{nope"}, "argument --engine-args: invalid json_object value"),
        ({"LOG_FORMAT": "xml"}, "argument --log-format: must be one of: plain, json"),
    ],
)
def test_bad_environment_values_are_usage_errors(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    env: dict[str, str],
    message: str,
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    err = usage_error(capsys, "serve")
    assert message in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--port", "abc"], "argument --port: invalid int value: 'abc'"),
        (["serve", "--max-model-len", "1k"], "argument --max-model-len: invalid int value"),
        (["serve", "--max-num-seqs", "1.5"], "argument --max-num-seqs: invalid int value: '1.5'"),
        (["serve", "--engine-args", '"text"'], "must be a JSON object"),
        (["serve", "--lora-target-modules", "q_proj;o_proj"], "not a list of module names"),
        (["serve", "--lora-target-modules", "q_proj,"], "not a list of module names"),
        (["serve", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["--log-format", "yaml", "serve"], "must be one of: plain, json"),
    ],
)
def test_bad_flags_are_usage_errors(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert message in usage_error(capsys, *argv)


def test_help_never_shows_the_api_key(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("API_KEY", "secret-key-xyz")
    with pytest.raises(SystemExit) as caught:
        parse("serve", "--help")
    assert caught.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "secret-key-xyz" not in text
    assert "[env API_KEY; default: unset]" in text
    assert "[env GRPC_PORT; default: 50051]" in text


# ---- main(): which command runs, with what


class Calls:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.serve: list[argparse.Namespace] = []
        self.prepare: list[argparse.Namespace] = []
        self.logging: list[tuple[str, str]] = []
        monkeypatch.setattr(cli, "run_serve", lambda args: self.serve.append(args) or 0)
        monkeypatch.setattr(cli, "run_prepare_model", lambda args: self.prepare.append(args) or 0)
        monkeypatch.setattr(cli, "exit_now", sys.exit)  # the real one ends the process at once
        monkeypatch.setattr(
            cli, "configure_logging", lambda level, fmt: self.logging.append((level, fmt))
        )


def main(*argv: str) -> int | str | None:
    with pytest.raises(SystemExit) as caught:
        cli.main(list(argv))
    return caught.value.code


def test_serve_is_the_default_command(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = Calls(monkeypatch)
    assert main("--port", "7000") == 0
    assert [args.port for args in calls.serve] == [7000]
    assert main() == 0
    assert [args.command for args in calls.serve] == ["serve", "serve"]
    assert calls.prepare == []
    assert calls.logging == [("INFO", "plain"), ("INFO", "plain")]


def test_explicit_commands(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = Calls(monkeypatch)
    assert main("--log-format", "json", "--log-level", "debug", "serve", "--port", "1") == 0
    assert main("prepare-model") == 0
    assert len(calls.serve) == 1 and len(calls.prepare) == 1
    assert calls.logging == [("debug", "json"), ("INFO", "plain")]


def test_version(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    calls = Calls(monkeypatch)
    assert main("--version") == 0
    assert capsys.readouterr().out.strip() == f"llm-completions {__version__}"
    assert calls.serve == []


def test_main_exits_with_the_commands_code(monkeypatch: pytest.MonkeyPatch) -> None:
    Calls(monkeypatch)
    monkeypatch.setattr(cli, "run_serve", lambda args: 1)
    assert main("serve") == 1


@pytest.mark.parametrize(
    "argv",
    [
        ("--log-level", "DEBUG", "--port", "7000"),
        ("--log-level=DEBUG", "--port", "7000"),
        ("--log-format", "plain", "--log-level", "DEBUG", "--port=7000"),
    ],
)
def test_top_level_options_work_without_an_explicit_serve(
    monkeypatch: pytest.MonkeyPatch, argv: tuple[str, ...]
) -> None:
    calls = Calls(monkeypatch)
    assert main(*argv) == 0
    assert calls.logging == [("DEBUG", "plain")]
    assert [args.port for args in calls.serve] == [7000]


def test_top_level_options_alone_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = Calls(monkeypatch)
    assert main("--log-format", "json") == 0
    assert calls.logging == [("INFO", "json")]
    assert [args.command for args in calls.serve] == ["serve"]


def test_an_option_value_named_serve_is_just_a_value(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = Calls(monkeypatch)
    assert main("--served-model-name", "serve") == 0
    assert main("--served-model-name", "prepare-model", "--port", "7000") == 0
    assert [args.served_model_name for args in calls.serve] == ["serve", "prepare-model"]
    assert calls.prepare == []


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], ["serve"]),
        (["--port", "1"], ["serve", "--port", "1"]),
        (["--log-level", "debug", "--port", "1"], ["--log-level", "debug", "serve", "--port", "1"]),
        (["--log-level=debug", "serve", "-h"], ["--log-level=debug", "serve", "-h"]),
        (["--log-format", "json", "prepare-model"], ["--log-format", "json", "prepare-model"]),
        (["--model", "serve"], ["serve", "--model", "serve"]),
        (["--help"], ["--help", "serve"]),  # argparse acts on --help first: the top-level help
        (["--log-level"], ["--log-level"]),  # the parser reports the missing value
    ],
)  # fmt: skip
def test_serve_goes_after_the_top_level_options(argv: list[str], expected: list[str]) -> None:
    assert cli.with_command(argv) == expected


def test_the_top_level_options_are_the_parsers(capsys: pytest.CaptureFixture[str]) -> None:
    parser = cli.build_parser()
    options = {
        option: action.nargs != 0
        for action in parser._actions
        if not isinstance(action, argparse._SubParsersAction)
        for option in action.option_strings
    }
    assert {name for name, takes_value in options.items() if takes_value} == set(
        cli.TOP_LEVEL_VALUE_OPTIONS
    )
    assert {name for name, takes_value in options.items() if not takes_value} == set(
        cli.TOP_LEVEL_SWITCHES
    )
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert tuple(commands.choices) == cli.COMMANDS


def test_top_level_help_lists_the_commands(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls = Calls(monkeypatch)
    assert main("--log-level", "DEBUG", "--help") == 0
    assert "{serve,prepare-model,tenants,batch}" in capsys.readouterr().out
    assert main("--port", "1", "--help") == 0  # after a serve option: serve's help
    assert "--max-num-queued-reqs" in capsys.readouterr().out
    assert calls.serve == []


def test_a_top_level_option_without_its_value_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls = Calls(monkeypatch)
    assert main("--log-level") == 2
    assert "argument --log-level: expected one argument" in capsys.readouterr().err
    assert calls.serve == []


@pytest.mark.parametrize(
    ("source", "value"), [("env", "verbose"), ("flag", "verbose"), ("flag", "warn")]
)
def test_an_unknown_log_level_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], source: str, value: str
) -> None:
    calls = Calls(monkeypatch)
    if source == "env":
        monkeypatch.setenv("LOG_LEVEL", value)
    argv = ("--log-level", value) if source == "flag" else ()
    assert main(*argv, "prepare-model") == 2
    err = capsys.readouterr().err
    assert (
        "argument --log-level: must be one of: DEBUG, INFO, WARNING, ERROR, CRITICAL (any case)"
        in err
    )
    assert "Traceback" not in err
    assert calls.prepare == [] and calls.logging == []


@pytest.mark.parametrize("value", ["debug", "Warning", "CRITICAL"])
def test_log_levels_in_any_case(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    calls = Calls(monkeypatch)
    assert main("--log-level", value, "prepare-model") == 0
    assert calls.logging == [(value, "plain")]


def test_every_known_log_level_is_one_logging_accepts() -> None:
    # configure_logging() passes the level, upper-cased, to Logger.setLevel.
    for level in cli.LOG_LEVELS:
        assert isinstance(logging.getLevelName(level), int)


POSITIVE_OPTIONS = [
    "--max-num-seqs",
    "--max-num-queued-reqs",
    "--max-num-queued-tokens",
    "--max-prompts",
    "--max-choices",
    "--max-prompt-tokens",
    "--max-constraint-bytes",
    "--max-message-bytes",
    "--tensor-parallel-size",
    "--pipeline-parallel-size",
    "--data-parallel-size",
]
NON_NEGATIVE_OPTIONS = ["--max-logit-bias"]


@pytest.mark.parametrize(
    ("option", "value"),
    [(option, value) for option in POSITIVE_OPTIONS for value in ("0", "-1")]
    + [(option, "-1") for option in NON_NEGATIVE_OPTIONS],
)
def test_limits_below_their_minimum_are_usage_errors(
    capsys: pytest.CaptureFixture[str], option: str, value: str
) -> None:
    minimum = 1 if option in POSITIVE_OPTIONS else 0
    err = usage_error(capsys, "serve", option, value)
    assert f"argument {option}: must be at least {minimum}" in err


def test_limits_at_their_minimum_are_accepted() -> None:
    args = parse("serve", *(arg for option in POSITIVE_OPTIONS for arg in (option, "1")))
    assert (args.max_num_seqs, args.max_message_bytes, args.data_parallel_size) == (1, 1, 1)
    args = parse("serve", "--max-logit-bias", "0")
    assert args.max_logit_bias == 0


def test_a_limit_from_the_environment_is_checked_too(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("MAX_NUM_QUEUED_REQS", "0")
    assert "argument --max-num-queued-reqs: must be at least 1" in usage_error(capsys, "serve")


@pytest.mark.parametrize(
    ("option", "env", "replacements"),
    [
        ("--max-in-flight", "MAX_IN_FLIGHT", ("--max-num-seqs", "--max-num-queued-reqs")),
        ("--max-waiting", "MAX_WAITING", ("--max-num-queued-reqs", "--max-num-queued-tokens")),
    ],
)
def test_the_removed_frontend_limits_are_refused_naming_what_replaced_them(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    option: str,
    env: str,
    replacements: tuple[str, ...],
) -> None:
    given_as_flag = usage_error(capsys, "serve", option, "32")
    monkeypatch.setenv(env, "32")
    given_in_environment = usage_error(capsys, "serve")
    for err in (given_as_flag, given_in_environment):
        assert f"argument {option}: was removed, with its env {env}" in err
        assert all(replacement in err for replacement in replacements)


# ---- run_serve(): the settings the server is built from


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[tuple[ServerSettings, EngineSettings]]:
    import service.transport.server

    received: list[tuple[ServerSettings, EngineSettings]] = []

    async def fake_serve(
        server: ServerSettings, engine: EngineSettings, role: None = None, standby: None = None
    ) -> int:
        received.append((server, engine))
        return 0

    monkeypatch.setattr(service.transport.server, "serve", fake_serve)
    # The engine core's copy of the server (service/model/standby_core.py) is not made here.
    monkeypatch.setattr(service.transport.server, "stand_by", lambda copies, modules=(): [])
    return received


def test_run_serve_builds_the_default_settings(
    served: list[tuple[ServerSettings, EngineSettings]],
) -> None:
    assert cli.run_serve(parse("serve")) == 0
    ((server, engine),) = served
    assert server == ServerSettings()
    assert engine == EngineSettings(
        model=None,
        served_model_name=DEFAULT_SERVED_MODEL_NAME,
        max_logprobs=ENGINE_MAX_LOGPROBS,  # what beam search's steps ask for
    )


def test_the_engine_allows_the_logprobs_beam_search_asks_for(
    served: list[tuple[ServerSettings, EngineSettings]],
) -> None:
    assert cli.run_serve(parse("serve")) == 0
    ((_, engine),) = served
    built = engine_args(engine, Path("/models/m"), ModelCatalog(engine.served_model_name))
    assert built.max_logprobs == 2 * MAX_BEST_OF  # a beam step of the widest beam


def test_run_serve_passes_every_option_on(
    served: list[tuple[ServerSettings, EngineSettings]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("API_KEY", "k")
    args = parse(
        "serve",
        "--host", "0.0.0.0", "--port", "6000", "--metrics-port", "9600", "--log-prompts",
        "--max-num-seqs", "4", "--max-num-queued-reqs", "8", "--max-num-queued-tokens", "9",
        "--max-prompts", "2",
        "--max-choices", "3", "--max-prompt-tokens", "100", "--max-constraint-bytes", "50",
        "--max-logit-bias", "5", "--max-message-bytes", "2048",
        "--drain-delay", "5", "--shutdown-grace", "1.5",
        "--model", "/models/my-llama", "--dtype", "bfloat16", "--max-model-len", "512",
        "--kv-cache-gib", "0.5", "--structured-outputs-backend", "guidance",
        "--tensor-parallel-size", "2", "--pipeline-parallel-size", "3",
        "--data-parallel-size", "4", "--distributed-executor-backend", "ray",
        "--engine-args", '{"max_num_seqs": 8}',
    )  # fmt: skip
    assert cli.run_serve(args) == 0
    ((server, engine),) = served
    assert server == ServerSettings(
        host="0.0.0.0",
        port=6000,
        shutdown_grace_seconds=1.5,
        drain_delay_seconds=5.0,
        max_message_bytes=2048,
        api_key="k",
        metrics_host="127.0.0.1",
        metrics_port=9600,
        log_prompts=True,
        limits=RequestLimits(
            max_prompts=2,
            max_choices=3,
            max_prompt_tokens=100,
            max_constraint_bytes=50,
            max_logit_bias=5,
        ),
    )
    assert engine == EngineSettings(
        model=Path("/models/my-llama"),
        served_model_name="my-llama",  # the directory's name
        dtype="bfloat16",
        max_model_len=512,
        kv_cache_gib=0.5,
        structured_outputs_backend="guidance",
        tensor_parallel_size=2,
        pipeline_parallel_size=3,
        data_parallel_size=4,
        distributed_executor_backend="ray",
        max_num_seqs=4,
        max_num_queued_reqs=8,
        max_num_queued_tokens=9,
        max_logprobs=ENGINE_MAX_LOGPROBS,
        extra_engine_args={"max_num_seqs": 8},
    )


def test_an_explicit_served_name_wins_over_the_directory_name(
    served: list[tuple[ServerSettings, EngineSettings]],
) -> None:
    cli.run_serve(parse("serve", "--model", "/models/x", "--served-model-name", "prod"))
    assert served[0][1].served_model_name == "prod"


# ---- settings.py


def test_settings_defaults_and_immutability() -> None:
    server = ServerSettings()
    assert (server.host, server.port, server.metrics_port, server.api_key) == (
        "127.0.0.1",
        50051,
        9400,
        None,
    )
    assert server.max_message_bytes == 16 * MIB
    assert (server.shutdown_grace_seconds, server.drain_delay_seconds) == (30.0, 0.0)
    assert server.limits == RequestLimits()
    engine = EngineSettings(model=None, served_model_name="m")
    assert (engine.dtype, engine.structured_outputs_backend, engine.extra_engine_args) == (
        "auto",
        "xgrammar",
        {},
    )
    assert EngineSettings(model=None, served_model_name="a").extra_engine_args is not (
        engine.extra_engine_args
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        server.port = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        RequestLimits().max_prompts = 1  # type: ignore[misc]


# ---- LoRA adapters


def test_lora_modules_take_several_names_and_the_flag_wins_over_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LORA_MODULES", "env=/adapters/env")
    args = parse("serve", "--lora-modules", "a=/x", "b=/y,c=/z", "--max-loras", "2")
    assert args.lora_modules == (
        LoraModule("a", Path("/x")),
        LoraModule("b", Path("/y")),
        LoraModule("c", Path("/z")),
    )
    assert args.max_loras == 2


@pytest.mark.parametrize("value", ["nameonly", "=/path", "name=", "a=/x,,b=/y"])
def test_a_lora_module_that_is_not_name_equals_path_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], value: str
) -> None:
    err = usage_error(capsys, "serve", "--lora-modules", value)
    assert "--lora-modules" in err and "NAME=PATH" in err


def test_a_bad_lora_modules_environment_value_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LORA_MODULES", "sql")
    assert "NAME=PATH" in usage_error(capsys, "serve")


def test_run_serve_checks_the_adapters_and_passes_them_on(
    served: list[tuple[ServerSettings, EngineSettings]],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    import service.model.adapter_checks

    checked: list[tuple[Any, ...]] = []
    monkeypatch.setattr(
        service.model.adapter_checks, "check_adapters", lambda *args: checked.append(args)
    )
    args = parse(
        "serve", "--model", str(tmp_path), "--lora-modules", "a=/x", "--max-lora-rank", "8"
    )
    assert cli.run_serve(args) == 0
    engine = served[0][1]
    assert (engine.lora_modules, engine.max_loras, engine.max_lora_rank) == (
        (LoraModule("a", Path("/x")),),
        1,
        8,
    )
    assert checked == [(engine.lora_modules, 8, tmp_path, tmp_path.name)]


def test_run_serve_refuses_a_bad_adapter_with_one_line_and_no_server(
    served: list[tuple[ServerSettings, EngineSettings]],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    args = parse("serve", "--model", str(tmp_path), "--lora-modules", f"bad={tmp_path}/none")
    assert cli.run_serve(args) == 1
    assert served == []
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("llm-completions: error: adapter `bad`")


REFUSED_START = """
import sys
from service import cli
args = cli.build_parser().parse_args(cli.with_command(sys.argv[1:]))
code = cli.run_serve(args)
print(code, sorted({name.split(".")[0] for name in sys.modules} & {"vllm", "torch"}))
"""


@pytest.mark.parametrize(
    "flags",
    [
        ("--lora-modules", "bad=/nowhere"),
        ("--tenants-file", "/nowhere.yaml"),
        ("--cpu-cores", "0-1", "--tensor-parallel-size", "3"),
    ],
)
def test_a_bad_file_or_flag_fails_start_up_before_vllms_imports(
    tmp_path: Path, flags: tuple[str, ...]
) -> None:
    """A replica given a bad adapter, tenants file or core list fails at once, without the
    seconds vLLM's imports take."""
    command = [sys.executable, "-c", REFUSED_START, "serve", "--model", str(tmp_path), *flags]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.stdout.split("\n")[0] == "1 []", done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("llm-completions: error:")


# ---- transport: keepalive and TLS


def test_keepalive_options_from_flags_and_the_environment(
    served: list[tuple[ServerSettings, EngineSettings]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KEEPALIVE_TIME_SECONDS", "12")
    monkeypatch.setenv("KEEPALIVE_MAX_PING_STRIKES", "3")
    args = parse(
        "serve", "--keepalive-timeout", "4", "--keepalive-min-ping-interval", "1.5"
    )  # fmt: skip
    assert cli.run_serve(args) == 0
    assert served[0][0].keepalive == KeepaliveSettings(
        time_seconds=12.0, timeout_seconds=4.0, min_ping_interval_seconds=1.5, max_ping_strikes=3
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["--keepalive-time", "0"],
        ["--keepalive-timeout", "-1"],
        ["--keepalive-min-ping-interval", "soon"],
        ["--keepalive-max-ping-strikes", "-1"],
    ],
)
def test_bad_keepalive_values_are_usage_errors(
    capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    assert argv[0] in usage_error(capsys, "serve", *argv)


def test_tls_options_reach_the_server_settings(
    served: list[tuple[ServerSettings, EngineSettings]],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    authority = CertificateAuthority(tmp_path)
    server = authority.server()
    monkeypatch.setenv("TLS_CERT_FILE", str(server.cert_file))
    args = parse(
        "serve", "--tls-key-file", str(server.key_file),
        "--tls-client-ca-file", str(authority.cert_file),
    )  # fmt: skip
    assert cli.run_serve(args) == 0
    assert served[0][0].tls == TlsSettings(server.cert_file, server.key_file, authority.cert_file)
    assert ServerSettings().tls is None  # plaintext by default


@pytest.mark.parametrize(
    ("given", "said"),
    [
        (["cert"], "--tls-cert-file and --tls-key-file go together"),
        (["key"], "--tls-cert-file and --tls-key-file go together"),
        (["ca"], "--tls-client-ca-file needs --tls-cert-file and --tls-key-file"),
        (["cert", "other-key"], "the key must be the certificate's"),
        (["cert", "key", "missing-ca"], "cannot use --tls-client-ca-file"),
    ],
)
def test_unusable_tls_options_are_refused_in_one_line_with_no_server(
    served: list[tuple[ServerSettings, EngineSettings]],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    given: list[str],
    said: str,
) -> None:
    authority = CertificateAuthority(tmp_path)
    server, other = authority.server("server"), authority.server("other")
    flags = {
        "cert": ["--tls-cert-file", str(server.cert_file)],
        "key": ["--tls-key-file", str(server.key_file)],
        "other-key": ["--tls-key-file", str(other.key_file)],
        "ca": ["--tls-client-ca-file", str(authority.cert_file)],
        "missing-ca": ["--tls-client-ca-file", str(tmp_path / "none.crt")],
    }
    assert cli.run_serve(parse("serve", *(flag for name in given for flag in flags[name]))) == 1
    assert served == []
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("llm-completions: error: ")
    assert said in err


# ---- placement


def test_cpu_cores_and_gpu_devices_reach_the_engine_settings(
    served: list[tuple[ServerSettings, EngineSettings]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPU_DEVICES", "1, 2")
    assert cli.run_serve(parse("serve", "--cpu-cores", "0")) == 0
    engine = served[0][1]
    assert (engine.cpu_cores, engine.gpu_devices) == ((0,), "1,2")


@pytest.mark.parametrize("value", ["x", "0-", "0,0", "4096"])
def test_bad_cpu_cores_are_usage_errors(capsys: pytest.CaptureFixture[str], value: str) -> None:
    assert "--cpu-cores" in usage_error(capsys, "serve", "--cpu-cores", value)


def test_cores_that_do_not_split_over_the_workers_are_refused(
    served: list[tuple[ServerSettings, EngineSettings]],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("service.options.available_cores", lambda: {0, 1, 2})
    args = parse("serve", "--cpu-cores", "0-2", "--tensor-parallel-size", "2")
    assert cli.run_serve(args) == 1
    assert served == []
    assert "cannot be split evenly over 2" in capsys.readouterr().err
