"""Command-line options for every program of the product (the service, Envoy's launcher, the
replica picker): each option also read from an environment variable, and converters that
refuse a bad value with a usage error naming the option."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any, NoReturn


def add_option(
    parser: argparse.ArgumentParser,
    flag: str,
    env: str,
    default: Any,
    help_text: str,
    convert: Callable[[str], Any] = str,
    secret: bool = False,
) -> None:
    raw = os.environ.get(env)
    # A text default is converted (and a bad one refused with a usage error) like a flag.
    value = raw if raw not in (None, "") else default
    shown = "unset" if secret else "%(default)s"  # a key from the environment is never printed
    parser.add_argument(
        flag, default=value, type=convert, help=f"{help_text} [env {env}; default: {shown}]"
    )


def one_of(*allowed: str, ignore_case: bool = False) -> Callable[[str], str]:
    """A converter that refuses any text but `allowed` (with `ignore_case`, in any case)."""

    def convert(text: str) -> str:
        if (text.upper() if ignore_case else text) not in allowed:
            suffix = " (any case)" if ignore_case else ""
            raise argparse.ArgumentTypeError(f"must be one of: {', '.join(allowed)}{suffix}")
        return text

    return convert


def at_least(minimum: int) -> Callable[[str], int]:
    """A converter to an int of at least `minimum`, e.g. a limit that makes no sense below 1."""

    def convert(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}")
        return value

    convert.__name__ = "int"  # argparse says "invalid int value" for text that is no integer
    return convert


positive_int = at_least(1)
non_negative_int = at_least(0)


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("must be a number above 0")
    return value


positive_float.__name__ = "float"  # argparse says "invalid float value" for text that is none


def add_removed_option(parser: argparse.ArgumentParser, flag: str, env: str, instead: str) -> None:
    """An option that no longer exists: given as a flag or in the environment, a usage error
    that says what replaced it."""

    def refuse(_: str) -> NoReturn:
        raise argparse.ArgumentTypeError(f"was removed, with its env {env}: {instead}")

    refuse.__name__ = "removed"
    # A text default goes through `type` too, so the environment variable is refused as well.
    parser.add_argument(
        flag, default=os.environ.get(env) or None, type=refuse, help=argparse.SUPPRESS
    )


def add_switch(parser: argparse.ArgumentParser, flag: str, env: str, help_text: str) -> None:
    enabled = os.environ.get(env, "").lower() in ("1", "true", "yes", "on")
    parser.add_argument(
        flag, action="store_true", default=enabled, help=f"{help_text} [env {env}=1; default: off]"
    )
