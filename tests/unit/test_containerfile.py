"""The Containerfile, read: hadolint's verdict, and the image's contract as the file states it
(the user, the engines, where every cache lives, no compiler in the CPU image, the default
command, the ports, the stop signal, what the build copies). tests/test_image_runtime.py runs
the same contract outside a container."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from fnmatch import fnmatch
from pathlib import Path

import pytest

from facade.render import DEFAULT_ADMIN_PORT, DEFAULT_HTTP_PORT
from image.containerfile import CONTAINERFILE, Containerfile, assignments, exec_form, expand
from service.cli import with_command
from service.model.default_model import cache_root
from service.settings import ServerSettings

ROOT = Path(__file__).resolve().parents[2]
IMAGE = Containerfile.read()
FINAL = IMAGE.final
ENGINES = ("cpu", "gpu")
PYPROJECT = (ROOT / "pyproject.toml").read_text()
HADOLINT = Path(sys.executable).parent / "hadolint"
COMPILERS = re.compile(r"\b(gcc|g\+\+|clang|build-essential|cc|c\+\+|make|cmake)\b")
IGNORE_PRAGMA = re.compile(r"^hadolint ignore=(?:DL|SC)\d{4}(?:,(?:DL|SC)\d{4})* # \S")
# The variables the brief of the image names; every path-valued one must lie in the volume.
CACHE_VARIABLES = (
    "HF_HOME",
    "LLM_COMPLETIONS_CACHE",
    "VLLM_CACHE_ROOT",
    "VLLM_CONFIG_ROOT",
    "XDG_CACHE_HOME",
    "XDG_CONFIG_HOME",
    "TORCHINDUCTOR_CACHE_DIR",
    "TRITON_CACHE_DIR",
)


def environment() -> dict[str, str]:
    return IMAGE.environment(FINAL, {"PATH": "/usr/bin"})


def volume() -> str:
    (declared,) = FINAL.of("VOLUME")
    (path,) = declared.arguments.split()
    return path


def test_hadolint_finds_nothing_at_warning_or_above() -> None:
    done = subprocess.run(
        [str(HADOLINT), "--failure-threshold", "warning", "--no-color", str(CONTAINERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_each_rule_hadolint_is_told_to_ignore_is_named_and_justified() -> None:
    pragmas = [
        line.removeprefix("#").strip()
        for line in CONTAINERFILE.read_text().splitlines()
        if line.strip().startswith("#") and "hadolint" in line
    ]
    assert pragmas, "none: drop this test's expectation of some"
    for pragma in pragmas:
        assert IGNORE_PRAGMA.match(pragma), f"name the rules and say why: {pragma!r}"


def test_the_image_runs_as_the_numeric_user_2000_in_group_0() -> None:
    users = [i.arguments for stage in IMAGE.stages for i in stage.of("USER")]
    assert users == ["2000:0"]
    assert FINAL.instructions.index(FINAL.of("USER")[0]) > max(
        FINAL.instructions.index(i) for i in FINAL.of("RUN")
    )


def test_engine_is_a_build_argument_with_a_runtime_stage_per_engine() -> None:
    assert IMAGE.global_args["ENGINE"] == "cpu"
    for engine in ENGINES:
        chain = IMAGE.chain(FINAL, engine)
        assert [stage.name for stage in chain] == [None, f"runtime-{engine}"]
        assert IMAGE.chain(IMAGE.stage("build"), engine)[-1].name == f"runtime-{engine}"
    for engine in ENGINES:  # the extra install.sh installs
        assert re.search(rf"^{engine} = \[", PYPROJECT, re.M), engine


def test_the_install_script_takes_exactly_the_engines() -> None:
    for engine in ("tpu", ""):
        done = subprocess.run(
            ["sh", "image/install.sh", "/nonexistent/venv", engine],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode == 2, done.stderr
        assert "cpu or gpu" in done.stderr or "usage" in done.stderr


def test_every_cache_and_config_path_lies_in_the_volume() -> None:
    env = environment()
    assert set(CACHE_VARIABLES) <= set(env)
    paths = {k: v for k, v in env.items() if v.startswith("/") and k not in ("PATH", "HOME")}
    outside = {k: v for k, v in paths.items() if not v.startswith(f"{volume()}/") and v != volume()}
    assert outside == {}
    assert not env["HOME"].startswith(volume())
    assert env["VLLM_NO_USAGE_STATS"] == "1" and env["DO_NOT_TRACK"] == "1"


def test_the_service_reads_its_model_cache_from_the_variable_the_image_sets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LLM_COMPLETIONS_CACHE", environment()["LLM_COMPLETIONS_CACHE"])
    assert str(cache_root()).startswith(f"{volume()}/")


def test_the_volume_is_the_users_and_group_writable() -> None:
    (made,) = [i for i in FINAL.of("RUN") if volume() in i.arguments]
    assert f"chown 2000:0 {volume()}" in made.arguments
    assert re.search(rf"chmod [0-7]?775 {volume()}\b", made.arguments)
    volume_at = FINAL.instructions.index(FINAL.of("VOLUME")[0])
    assert FINAL.instructions.index(made) < volume_at  # changes after VOLUME would be lost


def test_the_cpu_image_has_no_compiler_and_the_gpu_image_only_the_one_triton_needs() -> None:
    cpu = [i for stage in IMAGE.chain(FINAL, "cpu") for i in stage.of("RUN")]
    assert [i.arguments for i in cpu if COMPILERS.search(i.arguments)] == []
    gpu = [i for stage in IMAGE.chain(FINAL, "gpu") for i in stage.of("RUN")]
    with_compiler = [i for i in gpu if COMPILERS.search(i.arguments)]
    assert len(with_compiler) == 1
    assert set(COMPILERS.findall(with_compiler[0].arguments)) == {"gcc"}
    assert any("Triton" in comment for comment in with_compiler[0].comments)


def test_the_final_image_takes_only_the_install_from_the_build() -> None:
    copies = [i.arguments for i in FINAL.of("COPY") if "--from" in i.arguments]
    target = install_target()
    assert copies == [f"--from=build {target} {target}"]
    (install,) = [i for i in IMAGE.stage("build").of("RUN") if "image/install.sh" in i.arguments]
    assert "--mount=type=cache,target=/root/.cache/pip" in install.arguments


def install_target() -> str:
    (run,) = [i for i in IMAGE.stage("build").of("RUN") if "image/install.sh" in i.arguments]
    words = run.arguments.split()
    return words[words.index("image/install.sh") + 1]


def test_the_default_command_serves() -> None:
    assert exec_form(FINAL.of("CMD")[-1]) == ["llm-completions", "serve"]
    assert with_command([]) == ["serve"]
    (entrypoint,) = exec_form(FINAL.of("ENTRYPOINT")[-1])
    (source,) = [s for s, d in IMAGE.context_copies(FINAL) if d == entrypoint]
    assert source == ["image/entrypoint.sh"]
    (copy,) = [i for i in FINAL.of("COPY") if entrypoint in i.arguments]
    assert "--chmod=0755" in copy.arguments


@pytest.mark.parametrize(
    ("args", "runs"),
    [
        (["llm-completions", "serve"], "llm-completions serve"),
        (["serve", "--host", "0.0.0.0"], "llm-completions serve --host 0.0.0.0"),
        (["--log-format", "json"], "llm-completions --log-format json"),
        (["prepare-model"], "llm-completions prepare-model"),
        ([], "llm-completions"),
        (["python", "-m", "facade.launch"], "python -m facade.launch"),
    ],
)
def test_the_entrypoint_hands_arguments_to_the_service_or_runs_them(
    args: list[str], runs: str, tmp_path: Path
) -> None:
    for name in ("llm-completions", "python"):
        stub = tmp_path / name
        stub.write_text(f'#!/bin/sh\necho "{name} $*" "$(umask)"\n')
        stub.chmod(stub.stat().st_mode | stat.S_IXUSR)
    done = subprocess.run(
        ["sh", str(ROOT / "image" / "entrypoint.sh"), *args],
        env={**os.environ, "PATH": f"{tmp_path}:/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [*runs.split(), "0002"]


def test_it_exposes_the_default_ports_but_not_envoys_admin() -> None:
    (exposed,) = FINAL.of("EXPOSE")
    ports = {int(port) for port in exposed.arguments.split()}
    settings = ServerSettings()
    assert {settings.port, settings.metrics_port, DEFAULT_HTTP_PORT} <= ports
    assert DEFAULT_ADMIN_PORT not in ports


def test_sigterm_stops_it_and_the_drain_is_described() -> None:
    (stop,) = FINAL.of("STOPSIGNAL")
    assert stop.arguments == "SIGTERM"
    note = " ".join(stop.comments)
    assert "DRAIN_DELAY_SECONDS" in note and "SHUTDOWN_GRACE_SECONDS" in note


def test_the_build_copies_every_package_the_project_installs() -> None:
    copied = {
        source.rstrip("/")
        for sources, _ in IMAGE.context_copies(IMAGE.stage("build"))
        for source in sources
    }
    (listed,) = re.findall(r"^packages = \[(.*)\]$", PYPROJECT, re.M)
    packages = {name.split(".")[0] for name in re.findall(r'"([^"]+)"', listed)}
    (readme,) = re.findall(r'^readme = "(.+)"$', PYPROJECT, re.M)
    needed = packages | {"pyproject.toml", readme, "envoy.yaml"}
    assert needed | {"requirements", "clients/python", "image"} <= copied


def test_the_install_lists_every_package_of_the_source_tree() -> None:
    """setuptools installs only the packages pyproject.toml lists: a sub-package left out is
    missing from the image (and any non-editable install), while the editable checkout works."""
    (listed,) = re.findall(r"^packages = \[(.*)\]$", PYPROJECT, re.M)
    packages = set(re.findall(r'"([^"]+)"', listed))
    roots = {name.split(".")[0] for name in packages}
    found = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for root in roots
        for init in (ROOT / root).rglob("__init__.py")
    }
    assert found == packages


def copied_by(path: str, sources: list[str]) -> bool:
    """Whether a COPY of these sources brings the path (itself, or a directory above it)."""
    return any(path == s.rstrip("/") or path.startswith(s.rstrip("/") + "/") for s in sources)


def test_the_build_copies_each_engines_pins_and_the_install_requires_them(tmp_path: Path) -> None:
    sources = [s for found, _ in IMAGE.context_copies(IMAGE.stage("build")) for s in found]
    for engine in ENGINES:
        pins = f"requirements/constraints-{engine}.txt"
        assert (ROOT / pins).is_file(), pins
        assert copied_by(pins, sources), pins
        assert not ignored(pins, ignore_patterns()), pins
        done = subprocess.run(  # without its pins (a tree that lacks them): no install at all
            ["sh", str(ROOT / "image" / "install.sh"), str(tmp_path / "venv"), engine],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode == 2 and f"{pins} is missing" in done.stderr, done.stderr
        assert not (tmp_path / "venv").exists()
    install = (ROOT / "image" / "install.sh").read_text()
    assert "constraints=requirements/constraints-$engine.txt" in install
    assert re.search(r'^"\$pip" install -c "\$constraints" .*\./clients/python', install, re.M)


def test_make_reinstalls_when_the_engines_pins_change() -> None:
    makefile = (ROOT / "Makefile").read_text()
    (stamp,) = re.findall(r"^\$\(STAMP\):(.*)$", makefile, re.M)
    assert "requirements/constraints-$(ENGINE).txt" in stamp.split()


def ignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule, simplified: the last pattern matching the path or a parent decides."""
    verdict = False
    parts = path.split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    for pattern in patterns:
        negated = pattern.startswith("!")
        bare = pattern.removeprefix("!")
        for prefix in prefixes:
            name = prefix.rsplit("/", 1)[-1]
            if fnmatch(prefix, bare) or (bare.startswith("**/") and fnmatch(name, bare[3:])):
                verdict = not negated
    return verdict


def test_the_build_context_keeps_out_what_a_checkout_makes() -> None:
    assert (ROOT / ".containerignore").read_text() == (ROOT / ".dockerignore").read_text()
    patterns = ignore_patterns()
    for made in (".git", ".venv", ".pytest_cache", ".ruff_cache", ".hypothesis", "bench/results"):
        assert ignored(made, patterns), made
    for made in ("service/__pycache__", "clients/python/build", "llm_completions.egg-info", "site"):
        assert ignored(made, patterns), made
    for sources, _ in IMAGE.context_copies(IMAGE.stage("build")) + IMAGE.context_copies(FINAL):
        for source in sources:
            assert not ignored(source.rstrip("/"), patterns), source


def test_make_install_and_the_image_run_the_same_install_script() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^\tPYTHON=\$\(PYTHON\) sh image/install.sh --editable ", makefile, re.M)
    assert "IMAGE ?= llm-completions:$(ENGINE)" in makefile
    assert "-f Containerfile --build-arg ENGINE=$(ENGINE) -t $(IMAGE)" in makefile


def test_make_image_says_which_container_engine_it_needs() -> None:
    done = subprocess.run(
        ["make", "--no-print-directory", "image", "CONTAINER_TOOLS=no-such-container-engine"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "needs a working container engine: docker" in done.stderr


def test_labels_and_env_values_parse() -> None:
    for instruction in FINAL.of("LABEL") + FINAL.of("ENV"):
        assert assignments(instruction)
    assert expand("${ENGINE}-x $ENGINE", {"ENGINE": "gpu"}) == "gpu-x gpu"
