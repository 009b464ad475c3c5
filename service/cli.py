"""Command line: `serve` (the default) runs the gRPC server; `prepare-model` readies the
default model ahead of time; `tenants hash-key` prints the hash of a key for the tenants file;
`batch run INPUT OUTPUT` runs a batch job on a local engine.
Every option can also be set by the environment variable named in its help."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Sequence
from pathlib import Path

from plumbing.lifetime import exit_now
from service import __version__
from service.options import (
    add_batch_options,
    add_chat_options,
    add_engine_options,
    add_limit_options,
    add_media_options,
    add_option,
    add_server_options,
    add_transport_options,
    engine_settings,
    frontend_ports_problem,
    one_of,
    server_settings,
)
from service.settings import EngineSettings, ServerSettings
from service.transport.frontend_metrics import metrics_directory
from service.transport.logs import configure_logging

COMMANDS = ("serve", "prepare-model", "tenants", "batch")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# The options before the command: those that take a value, and those that take none.
TOP_LEVEL_VALUE_OPTIONS = ("--log-level", "--log-format")
TOP_LEVEL_SWITCHES = ("-h", "--help", "--version")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llm-completions",
        description=__doc__.splitlines()[0] + " " + " ".join(__doc__.splitlines()[1:]),
        # Top-level options only by their full names, as command_position() knows them.
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    add_option(
        parser,
        "--log-level",
        "LOG_LEVEL",
        "INFO",
        "logging level",
        one_of(*LOG_LEVELS, ignore_case=True),
    )
    add_option(
        parser,
        "--log-format",
        "LOG_FORMAT",
        "plain",
        "log lines as plain text or json",
        one_of("plain", "json"),
    )
    commands = parser.add_subparsers(dest="command")
    serve = commands.add_parser("serve", help="run the gRPC server (the default command)")
    add_server_options(serve)
    add_limit_options(serve)
    add_transport_options(serve)
    add_chat_options(serve)
    add_media_options(serve)
    add_batch_options(serve)
    add_engine_options(serve)
    commands.add_parser("prepare-model", help="convert the embedded default model into the cache")
    tenants = commands.add_parser("tenants", help="the tenants file's tools")
    tools = tenants.add_subparsers(dest="tool", required=True)
    tools.add_parser(
        "hash-key",
        help="print the sha256 the tenants file stores for the key read from standard input "
        "(one line; the key itself is stored nowhere)",
    )
    batch = commands.add_parser("batch", help="batch jobs on a local engine")
    batch_tools = batch.add_subparsers(dest="tool", required=True)
    run = batch_tools.add_parser(
        "run",
        help="run the requests of INPUT (a JSON list or JSONL of completion or chat requests) "
        "into OUTPUT (a JSON list of their answers) on a local engine; the same command "
        "resumes an interrupted job",
    )
    run.add_argument("input", type=Path, help="the requests")
    run.add_argument("output", type=Path, help="where the answers go")
    run.add_argument(
        "serve_options",
        nargs=argparse.REMAINDER,
        help="options of `serve` for the engine (e.g. --model DIR --max-model-len 4096)",
    )
    return parser


def run_serve(args: argparse.Namespace) -> int:
    from plumbing.tls import CertificateError
    from service.api.tenants import TenantsFileError
    from service.model.adapter_checks import AdapterError, check_adapters
    from service.model.default_model import model_directory
    from service.model.placement import PlacementError, binding
    from service.transport.tenants_file import read_table

    # The files and flags first, before vLLM's imports (seconds): a replica given a bad one
    # fails at once.
    try:
        engine = engine_settings(args)
        server = server_settings(args)
        if engine.cpu_cores:  # the cores must split evenly over the engine's workers
            binding(engine.cpu_cores, engine.tensor_parallel_size * engine.pipeline_parallel_size)
        if engine.lora_modules:
            check_adapters(
                engine.lora_modules,
                engine.max_lora_rank,
                model_directory(engine.model),
                engine.served_model_name,
            )
        if server.tenants_file is not None:
            read_table(server.tenants_file)  # a file that cannot be used stops the start
    except (AdapterError, CertificateError, PlacementError, TenantsFileError) as error:
        return refuse(error)
    if (problem := frontend_ports_problem(server)) is not None:
        return refuse(problem)
    with contextlib.ExitStack() as process_scope:
        if server.api_server_count > 1:
            process_scope.enter_context(metrics_directory())  # before vLLM's imports and ours
        return serve_checked(server, engine, (args.log_level, args.log_format))


def serve_checked(
    server: ServerSettings, engine: EngineSettings, log_setup: tuple[str, str]
) -> int:
    """Import vLLM, check what needs it, and serve; the exit code."""
    from plumbing.open_files import raise_open_files_limit
    from service.model.adapter_checks import AdapterError
    from service.model.standby_core import torch_loaded_single_threaded

    with torch_loaded_single_threaded():  # the engine core, frontends may be copies of this
        from service.api.chat import ChatSettingsError, check_chat_settings
        from service.api.media.connector import use_guarded_fetcher
        from service.model.adapters import check_max_lora_rank

    use_guarded_fetcher(server.chat.media)  # before vLLM caches its environment

    try:
        check_chat_settings(server.chat)
        if engine.lora_modules:
            check_max_lora_rank(engine.max_lora_rank)
    except (AdapterError, ChatSettingsError) as error:
        return refuse(error)
    raise_open_files_limit()  # each caller's connection is a file
    if server.api_server_count > 1:
        from service.transport.replica import run_replica

        return run_replica(server, engine, log_setup)
    from service.transport.server import run_server

    return run_server(server, engine)


def refuse(problem: object) -> int:
    """Say why the server does not start, in one line; the exit code."""
    print(f"llm-completions: error: {problem}", file=sys.stderr)
    return 1


def run_hash_key() -> int:
    from service.api.tenants import hash_key

    key = sys.stdin.readline().strip()
    if not key:
        print("llm-completions: error: give the key on standard input", file=sys.stderr)
        return 1
    print(hash_key(key))
    return 0


def run_prepare_model(_: argparse.Namespace) -> int:
    from service.model.default_model import prepare_default_model

    print(prepare_default_model())
    return 0


def command_position(argv: Sequence[str]) -> int:
    """Where the command stands, or belongs: after the top-level options and their values
    (past the end if the last option lacks its value)."""
    position = 0
    while position < len(argv):
        option, equals, _ = argv[position].partition("=")
        if option in TOP_LEVEL_VALUE_OPTIONS:
            position += 1 if equals else 2
        elif argv[position] in TOP_LEVEL_SWITCHES:
            position += 1
        else:
            break
    return position


def with_command(argv: list[str]) -> list[str]:
    """argv with `serve`, the default command, put after the top-level options unless the
    first argument after them names a command."""
    position = command_position(argv)
    if position > len(argv):
        return argv  # the last option lacks its value: the parser says so
    if position < len(argv) and argv[position] in COMMANDS:
        return argv
    return [*argv[:position], "serve", *argv[position:]]


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(with_command(list(sys.argv[1:] if argv is None else argv)))
    configure_logging(args.log_level, args.log_format)
    if args.command == "prepare-model":
        sys.exit(run_prepare_model(args))
    if args.command == "tenants":
        sys.exit(run_hash_key())
    if args.command == "batch":
        from service.batch_command import run_batch

        sys.exit(run_batch(args.input, args.output, args.serve_options))
    exit_now(run_serve(args))
