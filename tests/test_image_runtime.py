"""The image's runtime contract, held without a container engine.

The Containerfile's own install script installs the project into a directory of its own; then
the image's entrypoint and default command run from it as the image runs them: as user 2000 in
group 0 and no other group, with the Containerfile's ENV (read from it, its paths mapped to
directories here), HOME and the install read-only, the declared volume and /tmp the only
writable places, and no compiler (CC and CXX fail, as none is in the CPU image). The replica
must prepare the embedded model into the volume and serve a completion; Envoy's launcher and the
picker must run from the same install; SIGTERM must end the replica within seconds, exit code 0,
no process left; nothing may be written outside the volume and /tmp.

The install is the slow part (2-4 min from nothing with pip's cache warm, on 2 cores), so it
runs in the background from the session's start (`background`, tests/conftest.py), and the
module uses what that run made. It lives in $IMAGE_TEST_CACHE (default
/var/tmp/llm-completions-image-test), one directory per set of install inputs (the script, the
pyproject files, the pins, the interpreter), and every session runs the whole script again
over it (about 25 s: the project and its client are rebuilt and reinstalled from this tree,
the pinned dependencies found in place). New inputs start from an empty directory and remove
the old one; IMAGE_TEST_FRESH=1 installs from nothing into a temporary directory instead, in
the module.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from llmcompletions.client import CompletionClient

from image.containerfile import Containerfile, exec_form
from service.model.default_model import COMPLETE_MARKER, DEFAULT_SERVED_MODEL_NAME
from tests.conftest import ENGINE_START_TIMEOUT
from tests.engines import STARTS
from tests.processes import free_port, port_open

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="runs the replica as another user")

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
ENGINE = "cpu"
IMAGE = Containerfile.read()
FINAL = IMAGE.final
CACHE = Path(os.environ.get("IMAGE_TEST_CACHE", "/var/tmp/llm-completions-image-test"))
FRESH = os.environ.get("IMAGE_TEST_FRESH") == "1"
# What the install script reads: a change to any of these starts the install from nothing.
INSTALL_INPUTS = (
    "image/install.sh",
    "pyproject.toml",
    "clients/python/pyproject.toml",
    f"requirements/constraints-{ENGINE}.txt",
    "requirements/model.txt",
)
# The CPU base image's own variables that matter here (python:3.11-slim-bookworm's).
BASE_ENVIRONMENT = {
    "PATH": "/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
}
# This host's processor settings, which no test changes (see the workplace's notes).
HOST_VARIABLES = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
# What `docker run -e` adds here: loopback (a shared host, not a container's own network), an
# engine as small as the other tests' extra replicas (tests/conftest.py SMALL_ENGINE), and no
# compiler: a compile would fail here as it fails in the image.
RUN_SETTINGS = {
    "GRPC_HOST": "127.0.0.1",
    "METRICS_HOST": "127.0.0.1",
    "LISTEN_HOST": "127.0.0.1",
    "MAX_MODEL_LEN": "512",
    "KV_CACHE_GIB": "0.25",
    "CC": "/bin/false",
    "CXX": "/bin/false",
}
STOP_SECONDS = 10


def image_user() -> tuple[int, int]:
    (user,) = FINAL.of("USER")
    uid, _, gid = user.arguments.partition(":")
    return int(uid), int(gid)


def install_target() -> str:
    """Where the build stage installs: install.sh's VENV argument."""
    (run,) = [i for i in IMAGE.stage("build").of("RUN") if "image/install.sh" in i.arguments]
    words = run.arguments.split()
    return words[words.index("image/install.sh") + 1]


UID, GID = image_user()
INSTALL = install_target()
(VOLUME,) = FINAL.of("VOLUME")[0].arguments.split()
ENTRYPOINT = exec_form(FINAL.of("ENTRYPOINT")[-1])
CMD = exec_form(FINAL.of("CMD")[-1])
IMAGE_ENVIRONMENT = IMAGE.environment(FINAL, BASE_ENVIRONMENT)
AS_USER: dict[str, Any] = {"user": UID, "group": GID, "extra_groups": []}


def interpreter() -> Path:
    """This host's CPython of the base image's version that the image's user can run (this
    machine's default Python lives under /root, out of its reach)."""
    version = IMAGE.global_args["CPU_BASE"].split(":")[1].split("-")[0]
    for place in ("/usr/local/bin", "/usr/bin"):
        candidate = Path(place) / f"python{version}"
        if candidate.is_file() and runs_as_user([str(candidate), "-c", "pass"]):
            return candidate
    pytest.skip(f"no Python {version} that user {UID} can run in /usr/local/bin or /usr/bin")


def runs_as_user(command: list[str]) -> bool:
    done = subprocess.run(command, capture_output=True, timeout=60, cwd="/", **AS_USER)
    return done.returncode == 0


def install_key(python: Path) -> str:
    digest = hashlib.sha256(str(python).encode())
    digest.update(subprocess.check_output([str(python), "--version"]))
    for name in INSTALL_INPUTS:
        digest.update(name.encode() + b"\0" + (ROOT / name).read_bytes())
    return digest.hexdigest()[:16]


def copy_build_context(target: Path) -> None:
    """What the build stage COPYs from the context, where it copies it (under its WORKDIR)."""
    build = IMAGE.stage("build")
    (workdir,) = build.of("WORKDIR")
    junk = shutil.ignore_patterns("__pycache__", "*.pyc", "build", "*.egg-info")
    for sources, destination in IMAGE.context_copies(build):
        inside = target / Path(destination).relative_to(workdir.arguments)
        for source in sources:
            path = ROOT / source
            if path.is_dir():
                shutil.copytree(path, inside, ignore=junk, dirs_exist_ok=True)
            else:
                inside.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, inside / path.name)


def run_install(venv: Path, python: Path, log: Path, niceness: int = 0) -> float:
    """image/install.sh as the build stage runs it, at `niceness`; the seconds it took."""
    context = Path(tempfile.mkdtemp(prefix="image-context-"))
    try:
        copy_build_context(context)
        env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
        started = time.monotonic()
        with log.open("w") as output:
            done = subprocess.run(
                ["nice", "-n", str(niceness), "sh", "image/install.sh", str(venv), ENGINE],
                cwd=context,
                env={**env, "PYTHON": str(python)},
                stdout=output,
                stderr=subprocess.STDOUT,
                timeout=1800,
            )
        assert done.returncode == 0, f"image/install.sh failed:\n{log.read_text()[-3000:]}"
        return time.monotonic() - started
    finally:
        shutil.rmtree(context)


@contextlib.contextmanager
def installed(python: Path, log: Path, niceness: int = 0) -> Iterator[Path]:
    """The install directory, made or brought up to date by the install script."""
    if FRESH:
        scratch = Path(tempfile.mkdtemp(prefix="image-install-", dir="/var/tmp"))
        scratch.chmod(0o755)
        try:
            seconds = run_install(scratch / "venv", python, log)
            logger.info("image install from nothing: %.0f s", seconds)
            yield scratch / "venv"
        finally:
            shutil.rmtree(scratch)
        return
    CACHE.mkdir(mode=0o755, parents=True, exist_ok=True)
    venv = cached_install(python)
    with (CACHE / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for stale in CACHE.glob("venv-*"):
            if stale != venv:
                shutil.rmtree(stale)
        how = "over the cached install" if venv.exists() else "from nothing"
        seconds = run_install(venv, python, log, niceness)
    logger.info("image install %s: %.0f s", how, seconds)
    yield venv


def cached_install(python: Path) -> Path:
    return CACHE / f"venv-{install_key(python)}"


@dataclass
class Rootfs:
    """The image's paths, as directories of this host."""

    install: Path  # the install directory (/opt/llm-completions)
    volume: Path  # the volume (/cache)
    home: Path  # HOME, also the WORKDIR
    entrypoint: Path  # the ENTRYPOINT, a copy of image/entrypoint.sh

    def here(self, value: str) -> str:
        """An image path as the path of the same place here (other values unchanged)."""
        places = {
            INSTALL: self.install,
            VOLUME: self.volume,
            IMAGE_ENVIRONMENT["HOME"]: self.home,
            ENTRYPOINT[0]: self.entrypoint,
        }
        for image_path, path in places.items():
            if value == image_path or value.startswith(f"{image_path}/"):
                return f"{path}{value[len(image_path) :]}"
        return value

    def environment(self, **settings: str) -> dict[str, str]:
        env = {key: self.here(value) for key, value in IMAGE_ENVIRONMENT.items()}
        env["PATH"] = ":".join(self.here(part) for part in IMAGE_ENVIRONMENT["PATH"].split(":"))
        host = {key: os.environ[key] for key in HOST_VARIABLES if key in os.environ}
        return {**env, **host, **RUN_SETTINGS, **settings}

    def run(self, args: list[str], log: Path, **settings: str) -> subprocess.Popen[bytes]:
        """`docker run -e SETTINGS... IMAGE ARGS...` (no ARGS: the default command)."""
        with log.open("ab") as output:
            return subprocess.Popen(
                [self.here(ENTRYPOINT[0]), *ENTRYPOINT[1:], *(args or CMD)],
                env=self.environment(**settings),
                cwd=self.here(FINAL.of("WORKDIR")[-1].arguments),
                stdout=output,
                stderr=subprocess.STDOUT,
                **AS_USER,
            )


def new_directory(prefix: str, owner: int, mode: int) -> Path:
    """A directory in /tmp (pytest's own are private to root)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    os.chown(path, owner, 0)
    path.chmod(mode)
    return path


def entrypoint_source() -> Path:
    (source,) = [s for s, d in IMAGE.context_copies(FINAL) if d == ENTRYPOINT[0]]
    return ROOT / source[0]


def as_user_sees(paths: dict[str, Path], python: Path) -> dict[str, Any]:
    """The ids, and os.access(W_OK) of each path, in a process of the image's user."""
    code = (
        "import json, os, sys; paths = json.loads(sys.argv[1]); print(json.dumps({"
        "'ids': [os.getuid(), os.getgid(), os.getgroups()], "
        "**{name: os.access(path, os.W_OK) for name, path in paths.items()}}))"
    )
    arguments = json.dumps({name: str(path) for name, path in paths.items()})
    done = subprocess.run(
        [str(python), "-I", "-c", code, arguments],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
        check=True,
        **AS_USER,
    )
    return json.loads(done.stdout)


def directory_times(*roots: Path) -> dict[str, int]:
    """Each directory's modification time: adding, removing or renaming a file changes it."""
    times = {}
    for root in roots:
        for directory, _, _ in os.walk(root):
            times[directory] = os.stat(directory).st_mtime_ns
    return times


def made_by_user(directory: Path, since: float) -> list[str]:
    found = []
    with contextlib.suppress(FileNotFoundError):
        for entry in directory.iterdir():
            with contextlib.suppress(FileNotFoundError):
                info = entry.lstat()
                if info.st_uid == UID and info.st_ctime >= since:
                    found.append(str(entry))
    return found


def serving(target: str, service: str = "") -> bool:
    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=2
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def completes(url: str, body: dict[str, Any]) -> bool:
    try:
        return httpx.post(url, json=body, timeout=30).status_code == 200
    except httpx.HTTPError:
        return False


def wait_for(
    ready: Callable[[], bool], process: subprocess.Popen[bytes], timeout: float, log: Path
) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        tail = log.read_text(errors="replace")[-4000:]
        assert process.poll() is None, f"{process.args} exited with {process.returncode}:\n{tail}"
        assert time.monotonic() < deadline, f"not ready within {timeout:.0f} s:\n{tail}"
        time.sleep(0.5)


def descendants(process: subprocess.Popen[bytes]) -> list[psutil.Process]:
    try:
        return psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def stop(process: subprocess.Popen[bytes]) -> tuple[int, float]:
    """SIGTERM, as `docker stop` sends it: the exit code and the seconds until the exit
    (killed, -9, if it outlasts STOP_SECONDS)."""
    started = time.monotonic()
    process.send_signal(signal.SIGTERM)
    try:
        code = process.wait(timeout=STOP_SECONDS)
    except subprocess.TimeoutExpired:
        process.kill()
        code = process.wait()
    return code, time.monotonic() - started


def still_running(processes: list[psutil.Process]) -> list[str]:
    """Those of `processes` still running after a few seconds (a zombie has ended: its entry
    only waits for whoever reaps it)."""
    deadline = time.monotonic() + STOP_SECONDS
    while True:
        running = []
        for process in processes:
            with contextlib.suppress(psutil.NoSuchProcess):
                if process.status() != psutil.STATUS_ZOMBIE:
                    running.append(f"{process.pid} {process.name()}")
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.2)


@dataclass
class Replica:
    rootfs: Rootfs
    process: subprocess.Popen[bytes]
    grpc_port: int
    log: Path
    started: float  # time.time() as it started
    directories: dict[str, int]  # directory_times() of the read-only places before it started


def remove_made_by_user(directory: Path, since: float) -> None:
    """What the image's user left in `directory` since then (a container's /tmp goes with it;
    here the service's scratch directory, vLLM's sockets and Envoy's config would stay)."""
    for leftover in made_by_user(directory, since):
        path = Path(leftover)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


# The install ahead runs at the lowest CPU priority: from nothing it is minutes of CPU (pip
# unpacks and byte-compiles the whole engine), which at normal priority slowed the engine
# start-ups of both shards in the session's first minutes; the module needs it only at the
# fleet shard's end.
AHEAD_NICENESS = 19
INSTALLED_AHEAD = "installed ahead"


def background() -> str:
    """Brings the cached install up to date from the session's start (from nothing it takes
    minutes): the session's run of the whole script, whose result the module uses."""
    if FRESH or os.geteuid() != 0:
        return "nothing done ahead: the module installs from nothing, or is skipped"
    with installed(interpreter(), CACHE / "ahead-install.log", AHEAD_NICENESS):
        return INSTALLED_AHEAD


@pytest.fixture(scope="module")
def rootfs(tmp_path_factory: pytest.TempPathFactory, background_result: object) -> Iterator[Rootfs]:
    python = interpreter()
    log = tmp_path_factory.mktemp("image") / "install.log"
    started = time.time()
    # The session's run of the script over this tree, ahead: its result is used as it is.
    ahead = background_result == INSTALLED_AHEAD
    install_made = (
        contextlib.nullcontext(cached_install(python)) if ahead else installed(python, log)
    )
    with install_made as install:
        volume = new_directory("image-volume-", UID, 0o2775)  # as the Containerfile makes it
        home = new_directory("image-home-", 0, 0o755)
        bin_dir = new_directory("image-bin-", 0, 0o755)
        entrypoint = bin_dir / Path(ENTRYPOINT[0]).name
        shutil.copy(entrypoint_source(), entrypoint)
        entrypoint.chmod(0o755)
        try:
            yield Rootfs(install, volume, home, entrypoint)
        finally:
            for path in (volume, home, bin_dir):
                shutil.rmtree(path, ignore_errors=True)
            remove_made_by_user(Path("/tmp"), started)


@pytest.fixture(scope="module")
def replica(rootfs: Rootfs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replica]:
    log = tmp_path_factory.mktemp("image-replica") / "replica.log"
    before = directory_times(rootfs.install, rootfs.home, rootfs.entrypoint.parent)
    port = free_port()
    started = time.time()
    STARTS.record("image")
    process = rootfs.run([], log, GRPC_PORT=str(port), METRICS_PORT=str(free_port()))
    try:
        clock = time.monotonic()
        wait_for(lambda: serving(f"127.0.0.1:{port}"), process, ENGINE_START_TIMEOUT, log)
        logger.info("replica SERVING %.0f s after its start", time.monotonic() - clock)
        yield Replica(rootfs, process, port, log, started, before)
    finally:
        if process.poll() is None:
            stop(process)


def test_the_image_user_can_write_only_the_volume_and_tmp(rootfs: Rootfs) -> None:
    site_packages = next((rootfs.install / "lib").glob("python3.*/site-packages"))
    places = {
        "install": rootfs.install,
        "site-packages": site_packages,
        "home": rootfs.home,
        "entrypoint": rootfs.entrypoint.parent,
        "volume": rootfs.volume,
        "tmp": Path("/tmp"),
    }
    seen = as_user_sees(places, rootfs.install / "bin" / "python")
    assert seen.pop("ids") == [UID, GID, []]
    assert seen == {name: name in ("volume", "tmp") for name in places}
    assert rootfs.install.stat().st_uid == 0


def test_the_replica_prepares_the_default_model_in_the_volume_and_serves(
    replica: Replica,
) -> None:
    prepared = replica.rootfs.volume / "llm-completions" / "models" / DEFAULT_SERVED_MODEL_NAME
    assert (prepared / COMPLETE_MARKER).is_file(), sorted(replica.rootfs.volume.rglob("*"))
    assert prepared.stat().st_uid == UID
    with CompletionClient(f"127.0.0.1:{replica.grpc_port}", timeout=120) as client:
        reply = client.complete(
            model=DEFAULT_SERVED_MODEL_NAME,
            prompt="The capital of France is",
            max_tokens=4,
            temperature=0,
        )
    assert reply.choices[0].text.strip()


def test_envoy_and_the_picker_run_from_the_same_install(replica: Replica, tmp_path: Path) -> None:
    upstream = f"127.0.0.1:{replica.grpc_port}"
    http_port, admin_port, picker_port = free_port(), free_port(), free_port()
    envoy_log, picker_log = tmp_path / "envoy.log", tmp_path / "picker.log"
    launch = ["python", "-m", "facade.launch", "--upstream", upstream]
    ports = ["--http-port", str(http_port), "--admin-port", str(admin_port)]
    envoy = replica.rootfs.run([*launch, *ports], envoy_log)
    listen = ["--listen", f"127.0.0.1:{picker_port}", "--upstream", upstream]
    picker = replica.rootfs.run(["python", "-m", "facade.picker.server", *listen], picker_log)
    try:
        url = f"http://127.0.0.1:{http_port}/v2/completions"
        body = {"model": DEFAULT_SERVED_MODEL_NAME, "prompt": "Hello", "max_tokens": 2}
        wait_for(lambda: completes(url, body), envoy, 60, envoy_log)
        wait_for(lambda: port_open(picker_port), picker, 30, picker_log)
        wait_for(lambda: serving(f"127.0.0.1:{picker_port}", "liveness"), picker, 30, picker_log)
    finally:
        for process in (envoy, picker):
            children = descendants(process)
            code, _ = stop(process)
            assert code in (0, -signal.SIGTERM), f"{process.args} exited with {code}"
            assert still_running(children) == []


def test_sigterm_ends_the_replica_cleanly(replica: Replica) -> None:
    engine = descendants(replica.process)
    assert engine, "the engine's processes"
    code, seconds = stop(replica.process)
    logger.info("replica exited %.1f s after SIGTERM, exit code %d", seconds, code)
    assert code == 0, replica.log.read_text(errors="replace")[-4000:]
    assert seconds < STOP_SECONDS
    assert still_running(engine) == []


def test_nothing_was_written_outside_the_volume_and_tmp(replica: Replica) -> None:
    assert replica.process.poll() is not None, "runs once the replica has stopped"
    rootfs = replica.rootfs
    after = directory_times(rootfs.install, rootfs.home, rootfs.entrypoint.parent)
    assert after == replica.directories
    assert made_by_user(Path("/var/tmp"), replica.started) == []
    assert [p for p in rootfs.volume.rglob("*") if p.lstat().st_uid != UID] == []


VLLM_MODEL_INFO_CACHE = "modelinfos"  # under VLLM_CACHE_ROOT


def test_what_the_replica_made_in_the_volume_is_group_writable(replica: Replica) -> None:
    """The entrypoint's umask: another user id of group 0 (OpenShift gives each namespace its
    own) can reuse the volume's prepared model and caches. vLLM writes its model-info cache
    files 0600 whatever the umask (atomically, through a temporary file); another user id
    cannot read them, and vLLM then works the information out again, as for a missing file."""
    closed = [
        f"{path} {path.stat().st_mode & 0o777:o}"
        for path in [replica.rootfs.volume, *replica.rootfs.volume.rglob("*")]
        if not path.is_symlink()
        and path.stat().st_mode & 0o060 != 0o060
        and VLLM_MODEL_INFO_CACHE not in path.parts
    ]
    assert closed == []
