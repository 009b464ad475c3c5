"""The Containerfile read as its instructions and stages, for the tests that hold the image to
its contract: tests/unit/test_containerfile.py reads it, tests/test_image_runtime.py runs what it
says (its install script, its environment, its entrypoint and command) outside a container."""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONTAINERFILE = ROOT / "Containerfile"
VARIABLE = re.compile(r"\$(?:\{(\w+)\}|(\w+))")


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, ENV, ...
    arguments: str  # the rest, its continuation lines joined
    line: int  # where it starts, from 1
    comments: tuple[str, ...] = ()  # the comment lines right above it, without their '#'


@dataclass
class Stage:
    base: str  # as written, variables unexpanded
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def of(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]


def instructions(text: str) -> list[Instruction]:
    """Each instruction with its continuation lines joined (comment lines inside a continued
    instruction dropped, as the builders drop them)."""
    found: list[Instruction] = []
    comments: list[str] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if line.startswith("#"):
            if not pending:
                comments.append(line.removeprefix("#").strip())
            continue
        if not line and not pending:
            comments = []
            continue
        if not pending:
            start = number
        pending.append(line.removesuffix("\\").strip())
        if not line.endswith("\\"):
            keyword, _, rest = " ".join(part for part in pending if part).partition(" ")
            found.append(Instruction(keyword.upper(), rest.strip(), start, tuple(comments)))
            pending, comments = [], []
    return found


def stages(text: str) -> tuple[list[Instruction], list[Stage]]:
    """The instructions before the first FROM (global ARGs), and each stage."""
    preamble: list[Instruction] = []
    found: list[Stage] = []
    for instruction in instructions(text):
        if instruction.keyword == "FROM":
            words = instruction.arguments.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            found.append(Stage(words[0], name, [instruction]))
        elif found:
            found[-1].instructions.append(instruction)
        else:
            preamble.append(instruction)
    return preamble, found


def assignments(instruction: Instruction) -> dict[str, str]:
    """An ENV's, LABEL's or ARG's KEY=VALUE pairs (an ARG without a default maps to '')."""
    pairs: dict[str, str] = {}
    for word in shlex.split(instruction.arguments):
        key, equals, value = word.partition("=")
        if not equals and instruction.keyword != "ARG":
            raise ValueError(f"line {instruction.line}: {word!r} is not KEY=VALUE")
        pairs[key] = value
    return pairs


def expand(value: str, variables: Mapping[str, str]) -> str:
    """$NAME and ${NAME} replaced by their values ('' where unset), as the builder does."""
    return VARIABLE.sub(lambda match: variables.get(match[1] or match[2], ""), value)


def exec_form(instruction: Instruction) -> list[str]:
    """A CMD's or ENTRYPOINT's JSON array."""
    words = json.loads(instruction.arguments)
    if not isinstance(words, list) or not all(isinstance(word, str) for word in words):
        raise ValueError(f"line {instruction.line}: not the exec form: {instruction.arguments}")
    return words


@dataclass
class Containerfile:
    preamble: list[Instruction]
    stages: list[Stage]

    @classmethod
    def read(cls, path: Path = CONTAINERFILE) -> Containerfile:
        return cls(*stages(path.read_text()))

    @property
    def global_args(self) -> dict[str, str]:
        found: dict[str, str] = {}
        for instruction in self.preamble:
            if instruction.keyword == "ARG":
                found.update(assignments(instruction))
        return found

    def stage(self, name: str) -> Stage:
        (found,) = [stage for stage in self.stages if stage.name == name]
        return found

    @property
    def final(self) -> Stage:
        return self.stages[-1]

    def chain(self, stage: Stage, engine: str) -> list[Stage]:
        """The stage and the stages it is built FROM, nearest first, for this ENGINE."""
        args = {**self.global_args, "ENGINE": engine}
        found = [stage]
        names = {other.name: other for other in self.stages if other.name}
        while (base := expand(found[-1].base, args)) in names:
            found.append(names[base])
        return found

    def environment(self, stage: Stage, base: Mapping[str, str]) -> dict[str, str]:
        """A container's environment: `base` (the base image's) with the stage's ENV lines
        applied in order, each value expanded against the variables set before it."""
        variables = dict(base)
        for instruction in stage.of("ENV"):
            for key, value in assignments(instruction).items():
                variables[key] = expand(value, variables)
        return variables

    def context_copies(self, stage: Stage) -> list[tuple[list[str], str]]:
        """The stage's COPY instructions from the build context (not --from another stage):
        (sources, destination)."""
        found = []
        for instruction in stage.of("COPY"):
            words = shlex.split(instruction.arguments)
            if any(word.startswith("--from") for word in words):
                continue
            paths = [word for word in words if not word.startswith("--")]
            found.append((paths[:-1], paths[-1]))
        return found
