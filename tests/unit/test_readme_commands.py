"""The commands a reader copies from README.md and docs/ name only what exists: every `make X`
is a Makefile target, every option of `llm-completions`, `python -m facade.launch` and
`python -m facade.picker.server` is one its parser has, every variable set in front of them is
one a program or the Makefile reads, every REST path is one the facade serves, every gRPC
method or symbol grpcurl is given is in the proto, and every Python example compiles and
imports only names that exist. What the calls return is checked against a running stack by
tests/test_readme_calls.py (the README's, as written) and the real-process tests of each
surface (tests/test_grpc_tooling.py, test_rest_completions.py, test_client.py, ...)."""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import re
import shlex
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

import facade.options
import facade.picker.server
from service import cli

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
MAKEFILE = (ROOT / "Makefile").read_text()
PROTO = (ROOT / "proto" / "llmcompletions" / "v2" / "completions.proto").read_text()
REST_PATHS = [*json.loads((ROOT / "facade" / "openapi.json").read_text())["paths"], "/openapi.json"]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
SHELL_OPERATORS = {"&", "&&", "|", "||", ";", "(", ")"}
ASSIGNMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=")
# What the programs read at run time beyond their parsers' options (names in the source).
SOURCE_DIRS = ("service", "facade", "plumbing")


@dataclass(frozen=True)
class Block:
    page: str
    language: str
    text: str

    @property
    def id(self) -> str:
        first = self.text.strip().splitlines()[0] if self.text.strip() else ""
        return f"{self.page}: {first[:60]}"


def blocks() -> Iterator[Block]:
    for page in PAGES:
        for language, text in FENCE.findall(page.read_text()):
            yield Block(str(page.relative_to(ROOT)), language, text)


SHELL_BLOCKS = [block for block in blocks() if block.language == "sh"]
PYTHON_BLOCKS = [block for block in blocks() if block.language == "python"]


def one_line_per_command(script: str) -> str:
    """The script with its comments dropped, its continuations joined, and every line end
    outside quotes a `;` (a quoted JSON body may span lines)."""
    out: list[str] = []
    quote = ""
    comment = False
    previous = "\n"
    for char in script.replace("\\\n", " "):
        if comment:
            comment = char != "\n"
            if not comment:
                out.append(" ; ")
        elif quote:
            out.append(char)
            quote = "" if char == quote else quote
        elif char in "'\"":
            out.append(char)
            quote = char
        elif char == "#" and previous.isspace():
            comment = True
        else:
            out.append(" ; " if char == "\n" else char)
        previous = char
    return "".join(out)


def commands(script: str) -> Iterator[list[str]]:
    """Each simple command of a shell script, as its words (operators dropped)."""
    lexer = shlex.shlex(one_line_per_command(script), posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = ""
    words: list[str] = []
    for token in lexer:
        if token in SHELL_OPERATORS:
            if words:
                yield words
            words = []
        else:
            words.append(token)
    if words:
        yield words


def makefile_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z][\w-]*):(?!=)", MAKEFILE, re.M))


def makefile_variables() -> set[str]:
    return set(re.findall(r"\$\((\w+)\)", MAKEFILE)) | set(
        re.findall(r"^(\w+)\s*[?:]?=", MAKEFILE, re.M)
    )


class RecordingEnviron(dict[str, str]):
    """os.environ's stand-in: the variables a parser reads while it is built."""

    def __init__(self) -> None:
        super().__init__()
        self.read: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)


PARSERS: dict[str, Callable[[], argparse.ArgumentParser]] = {
    "llm-completions": cli.build_parser,
    "facade.launch": lambda: facade.options.build_parser("facade.launch"),
    "facade.picker.server": facade.picker.server.build_parser,
}


def options_and_variables() -> tuple[dict[str, set[str]], set[str]]:
    """Each program's option strings (its subcommands' included), and every variable their
    parsers read."""
    environ = RecordingEnviron()
    options: dict[str, set[str]] = {}
    with mock.patch.object(os, "environ", environ):
        for name, make in PARSERS.items():
            found: set[str] = set()
            parsers = [make()]
            while parsers:
                parser = parsers.pop()
                for action in parser._actions:
                    if isinstance(action, argparse._SubParsersAction):
                        parsers.extend(action.choices.values())
                    found.update(action.option_strings)
            options[name] = found
    return options, environ.read


OPTIONS, PARSER_VARIABLES = options_and_variables()


def source_variables() -> set[str]:
    """Upper-case string literals in the programs' sources: the variables they read at run time
    (GRPC_PORT in facade.stack, API_KEY in the launcher, ...)."""
    names: set[str] = set()
    for directory in SOURCE_DIRS:
        for source in (ROOT / directory).rglob("*.py"):
            names.update(re.findall(r"[\"']([A-Z][A-Z0-9_]{2,})[\"']", source.read_text()))
    return names


KNOWN_VARIABLES = PARSER_VARIABLES | source_variables() | makefile_variables()


def known_variable(name: str) -> bool:
    return name in KNOWN_VARIABLES or name.startswith("OTEL_")  # OpenTelemetry's own


def program_of(words: list[str]) -> tuple[str | None, list[str]]:
    """Which of our programs a command runs (None for anyone else's), and its arguments."""
    head = words[0].rsplit("/", 1)[-1]
    if head == "make":
        return "make", words[1:]
    if head == "llm-completions":
        return "llm-completions", words[1:]
    if re.fullmatch(r"python3?", head) and len(words) > 2 and words[1] == "-m":
        module = words[2]
        return ("llm-completions" if module == "service" else module), words[3:]
    return None, words[1:]


def method_names() -> set[str]:
    service = re.search(r"^service CompletionService \{(.*?)^\}", PROTO, re.M | re.S)
    assert service is not None
    return set(re.findall(r"^\s*rpc (\w+)\(", service.group(1), re.M))


def proto_symbols() -> set[str]:
    names = set(re.findall(r"^(?:message|enum|service) (\w+)", PROTO, re.M))
    return {f"llmcompletions.v2.{name}" for name in names}


def rest_path(word: str) -> str | None:
    """The path of a URL (with or without a scheme) on one of our REST ports."""
    match = re.match(r"^(?:https?://)?[\w.-]+:\d+(/[^\s?]*)", word)
    return match.group(1) if match else None


def serves(path: str) -> bool:
    return any(
        re.fullmatch(re.sub(r"\{\w+\}", r"[^/]+", known), path) is not None for known in REST_PATHS
    )


def problems(words: list[str]) -> list[str]:
    found: list[str] = []
    assignments = []
    while words and ASSIGNMENT.match(words[0]):
        assignments.append(ASSIGNMENT.match(words[0]).group(1))  # type: ignore[union-attr]
        words = words[1:]
    if not words:
        return found  # a shell variable of the script's own (NS=..., KEY=...)
    name, arguments = program_of(words)
    head = words[0].rsplit("/", 1)[-1]
    if name is not None:
        found += [f"{name} reads no {var}" for var in assignments if not known_variable(var)]
    if name == "make":
        for word in arguments:
            variable = ASSIGNMENT.match(word)
            if variable and not known_variable(variable.group(1)):
                found.append(f"the Makefile has no variable {variable.group(1)}")
            elif not variable and not word.startswith("-") and word not in makefile_targets():
                found.append(f"the Makefile has no target {word}")
    elif name in OPTIONS:
        for word in arguments:
            option = word.split("=", 1)[0]
            if option.startswith("--") and option not in OPTIONS[name]:
                found.append(f"{name} has no option {option}")
    elif name is not None and name.startswith(("bench.", "service.", "facade.", "proto.")):
        module = ROOT / (name.replace(".", "/") + ".py")
        if not module.exists() and not (ROOT / name.replace(".", "/")).is_dir():
            found.append(f"no module {name}")
    if head == "curl":
        for word in words[1:]:
            path = rest_path(word)
            if path is not None and not serves(path):
                found.append(f"the facade serves no {path}")
    if head == "grpcurl":
        for word in words[1:]:
            method = word.removeprefix("llmcompletions.v2.CompletionService/")
            if method != word and method not in method_names():
                found.append(f"the proto has no method {word}")
        if "describe" in words:
            symbol = words[words.index("describe") + 1]
            if symbol not in proto_symbols():
                found.append(f"the proto has no {symbol}")
    return found


@pytest.mark.parametrize("block", SHELL_BLOCKS, ids=[block.id for block in SHELL_BLOCKS])
def test_each_shell_block_names_only_what_exists(block: Block) -> None:
    found = [problem for words in commands(block.text) for problem in problems(words)]
    assert not found, found


def test_the_readme_sets_up_with_make_serve_and_make_test_alone() -> None:
    readme = (ROOT / "README.md").read_text()
    set_up = readme.split("## Set up", 1)[1].split("\n## ", 1)[0]
    assert [text.strip() for _, text in FENCE.findall(set_up)] == ["make serve", "make test"]


def test_the_checks_catch_what_they_are_for() -> None:
    """Each check on a command that is wrong in its way."""
    wrong = (
        "make serv\n"
        "NO_SUCH_VARIABLE=1 make serve\n"
        "llm-completions serve --no-such-option 1\n"
        ".venv/bin/python -m facade.launch --upstream 127.0.0.1:1 --no-such-launch-option\n"
        "curl -s http://127.0.0.1:8080/v2/no-such-route\n"
        ".venv/bin/grpcurl -plaintext 127.0.0.1:50051 llmcompletions.v2.CompletionService/Nope\n"
    )
    found = [problem for words in commands(wrong) for problem in problems(words)]
    assert found == [
        "the Makefile has no target serv",
        "make reads no NO_SUCH_VARIABLE",
        "llm-completions has no option --no-such-option",
        "facade.launch has no option --no-such-launch-option",
        "the facade serves no /v2/no-such-route",
        "the proto has no method llmcompletions.v2.CompletionService/Nope",
    ]


def imported_names(tree: ast.AST) -> Iterator[tuple[str, str]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                yield node.module, alias.name


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=[block.id for block in PYTHON_BLOCKS])
def test_each_python_example_compiles_and_imports_what_exists(block: Block) -> None:
    tree = ast.parse(block.text)
    for module, name in imported_names(tree):
        assert hasattr(importlib.import_module(module), name), f"{module} has no {name}"
