"""The real-process suite's engines and stacks, shared across modules (tests/engines.py says
how): the default stack (the real engine on the default model, and a real Envoy), vLLM's own
server beside it, a stack serving LoRA adapters with vLLM's server on the same adapters, a
fleet of two traced replicas, and a small engine for capacity and lifecycle. Modules run in
an order that keeps each shared engine's users together, so that it is stopped once they are
done."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from llmcompletions.v2 import completions_pb2_grpc
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from bench.servers import VllmOpenAIServer
from bench.tiny_vlm import prepare_tiny_vlm
from service.api.tenants import hash_key
from service.model.default_model import DEFAULT_SERVED_MODEL_NAME, prepare_default_model
from service.model.placement import CPU_BIND_ENV
from tests.engines import STARTS, Engine, SharedEngines
from tests.models import ADAPTER_MODULES, ADAPTER_TARGETS, build_adapter, with_bos_tokenizer
from tests.otlp import OtlpReceiver
from tests.processes import HealthWatch, TestStack, free_port
from tests.redis_server import RedisServer, start_redis
from tests.shards import SHARD_ENV, may_start

MODEL = DEFAULT_SERVED_MODEL_NAME
MAX_MODEL_LEN = 2048
API_KEY = "test-key-0123456789"
# The LoRA stack's operator key: it alone may load and unload adapters there.
OPERATOR_KEY = "test-operator-key-0123"
# The LoRA stack's engine: adapters at start, plus runtime ones past them (--max-cpu-loras's
# default there is the two at start plus --max-loras: two more).
LORA_RUNTIME_ARGS = ("--max-adapters", "8", "--max-adapter-bytes", "20000000")
# A second caller of the same server (it accepts both keys): cancels are scoped by key.
OTHER_API_KEY = "other-key-9876543210"
# The default stack's tenants (tests/test_tenants.py), beside API_KEY's keys: each key is
# stored in the file as its hash only.
TENANT_KEYS = {
    "team-a": "team-a-key-5551",
    "team-b": "team-b-key-5552",
    "burst": "burst-key-5553",
    "metered": "metered-key-5554",
    "shared": "shared-key-5555",
}
TENANT_LIMITS = {"burst": "{rpm: 2}", "metered": "{tpm: 100000}", "shared": "{rpm: 3}"}
TENANT_MODELS = {"team-a": [MODEL], "team-b": ["someone-elses-*"]}
# Engine settings small enough that several engines fit on this machine at once.
SMALL_ENGINE = ["--max-model-len", "512", "--kv-cache-gib", "0.25"]
AUTH_HEADERS = {"Authorization": f"Bearer {API_KEY}"}
GRPC_AUTH = (("authorization", f"Bearer {API_KEY}"),)
ENGINE_START_TIMEOUT = 600
# Chat replies parse tool calls as `vllm serve --tool-call-parser hermes` does; the same flags
# for both servers.
CHAT_FLAGS = ["--tool-call-parser", "hermes", "--enable-auto-tool-choice"]
# The server's own keepalive, shortened from its defaults (30 s, 20 s) so that a vanished
# caller is noticed within seconds (tests/test_keepalive.py).
SERVER_KEEPALIVE_SECONDS = 5

# The adapter stack: the base model under a name of its own (so that it is a pool of its own
# beside the default stack's), and two adapters made in the session.
LORA_MODEL = "smollm2-lora"
ADAPTER_SEEDS = {"a1": 1, "a2": 2}
# The fleet's replicas send their spans every 0.2 s (the SDK's default is 5 s).
TRACE_BATCH_ENV = {"OTEL_BSP_SCHEDULE_DELAY": "200"}
# The small engine: a batch of 4, priority scheduling and small backlog bounds (waiting,
# refusing and ordering show within seconds), on a variant of the default model whose
# tokenizer adds a BOS token; JSON logs with prompts.
BOS_MODEL = "smollm2-with-bos"
SMALL_BATCH = 4
SMALL_QUEUED_REQS = 40
SMALL_QUEUED_TOKENS = 2000

# The image stack: the tiny vision-language model (bench/tiny_vlm.py) served by ours and by
# vLLM's server with the same media settings: images from the loopback host the tests serve,
# two per prompt. Ours also bounds each image (1 MB, a 3 s fetch).
VLM_MODEL = "tiny-vlm"
VLM_ALLOWED_HOST = "127.0.0.1"
VLM_IMAGES_PER_PROMPT = 2
VLM_MAX_MEDIA_BYTES = 1_000_000
VLM_FETCH_TIMEOUT_SECONDS = 3
VLM_MEDIA_FLAGS = [
    *("--allowed-media-domains", VLM_ALLOWED_HOST),
    *("--limit-mm-per-prompt", json.dumps({"image": VLM_IMAGES_PER_PROMPT})),
]

# The default stack's first modules, in this order, before every other: those that need only
# the default stack, while vLLM's server starts beside it; then vLLM's server's modules, after
# which it stops and the adapter pair starts in its place while the other modules run; the
# first of them the keepalive tests, whose minute-long held call mostly waits, while the pair's
# start-up computes.
FIRST_MODULES = (
    "test_auth.py",
    "test_beam_search.py",
    "test_burst.py",
    "test_chat.py",
    "test_vllm_parity.py",
    "test_keepalive.py",
)
# Modules that share an engine run next to each other, in this order, after every other
# module (which use the default stack); each shared engine stops after its last user. Within
# a group, those that stop or kill a shared process come last.
LATE_MODULES = (
    "test_adapters.py",  # the adapter stack and vLLM's with adapters
    "test_runtime_adapters.py",  # the adapter stack (it puts away every adapter it adds)
    "test_pools.py",  # the default stack and the adapter stack as two pools
    "test_fleet_adapters.py",  # a pair of its own, stopped before the fleet starts
    "test_capacity.py",  # the small engine, beside the fleet
    "test_service_lifecycle.py",  # the small engine (its last test drains and stops it)
    "test_tracing.py",  # the fleet (its last test stops the fleet's span receiver)
    "test_prefix_routing.py",  # the fleet (its last test kills a replica)
    "test_engine_death.py",  # the fleet's other replica: its engine is killed
    "test_tls.py",
    "test_multi_replica.py",
    "test_engine_lifetime.py",
    "test_image_runtime.py",
    "test_gpu_pins.py",  # its resolver runs in the background from the start: last, to wait least
)
# Fixtures that hand out a shared engine, and the engine.
SHARED_FIXTURES = {
    "stack": "main",
    "batch_root": "main",
    "vllm_server": "vllm",
    "lora_stack": "lora",
    "vllm_lora_server": "vllm-lora",
    "fleet_replicas": "fleet",
    "small_stack": "small",
    "vlm_stack": "vlm",
    "vllm_vlm_server": "vllm-vlm",
}
# Started together when a test first needs one of them (those that tests still need). The
# adapter pair starts only once vLLM's server has stopped (SHARED's successors): each engine's
# processes hold about 4.5 GiB (top: worker 2.6-2.8, server 1.1, engine core 0.8), so four at
# once beside the other shard's would come close to a 24 GiB host's memory.
SHARED_GROUPS = (
    frozenset({"main", "vllm"}),
    frozenset({"lora", "vllm-lora"}),
    frozenset({"vlm", "vllm-vlm"}),
)


@dataclass
class VllmServer:
    """vLLM's own server as a shared engine."""

    server: VllmOpenAIServer

    def wait_ready(self) -> None:
        self.server.wait_ready()

    def stop(self) -> None:
        self.server.stop()


@dataclass
class ReadyStack:
    """A stack as a shared engine: ready once the service serves (and Envoy routes to it)."""

    stack: TestStack
    with_envoy: bool = True
    redis: RedisServer | None = None  # the tenants' limits store it uses, if any
    batch_root: Path | None = None  # where its batch jobs' files may be

    def wait_ready(self) -> None:
        if self.with_envoy:
            self.stack.wait_ready(ENGINE_START_TIMEOUT)
        else:
            self.stack.wait_ready_service(ENGINE_START_TIMEOUT)

    def stop(self) -> None:
        self.stack.stop()
        if self.redis is not None:
            self.redis.stop()


@dataclass
class ReplicaPair:
    """Two replicas of the small engine, each on a core of its own."""

    replicas: list[TestStack]

    def wait_ready(self) -> None:
        for replica in self.replicas:
            replica.wait_ready_service(ENGINE_START_TIMEOUT)

    def stop(self) -> None:
        for replica in self.replicas:
            replica.stop()

    def alive(self) -> list[TestStack]:
        return [r for r in self.replicas if r.processes and r.processes[0].poll() is None]


@dataclass
class FleetReplicas(ReplicaPair):
    """The fleet: two replicas sending their spans to `receiver`."""

    receiver: OtlpReceiver

    def stop(self) -> None:
        super().stop()
        self.receiver.stop()


@dataclass
class SmallStack:
    """The small engine behind its own Envoy, its health watched from before it listens."""

    stack: TestStack
    health: HealthWatch

    def wait_ready(self) -> None:
        self.stack.wait_ready(ENGINE_START_TIMEOUT)

    def stop(self) -> None:
        self.health.done.set()
        self.stack.stop()


def on_free_ports(engine: str, service_args: list[str], log: Path, **options: object) -> TestStack:
    """A stack on free ports (gRPC, REST, Envoy's admin, metrics) with its log in `log`."""
    return TestStack(
        grpc_port=free_port(),
        http_port=free_port(),
        admin_port=free_port(),
        service_args=[*service_args, "--metrics-port", str(free_port())],
        service_log=log,
        engine=engine,
        **options,  # type: ignore[arg-type]
    )


def tenants_yaml(extra_keys: dict[str, str] | None = None) -> str:
    """The default stack's tenants file, with `extra_keys` (key id -> key) added to team-a."""
    lines = ["version: 1", "tenants:"]
    for tenant, key in TENANT_KEYS.items():
        keys = [(f"{tenant}-1", key)]
        if tenant == "team-a":
            keys += list((extra_keys or {}).items())
        listed = ", ".join(f"{{id: {i}, sha256: {hash_key(k)}}}" for i, k in keys)
        lines += [f"  {tenant}:", f"    keys: [{listed}]"]
        if tenant in TENANT_MODELS:
            lines.append(f"    models: {TENANT_MODELS[tenant]}")
        if tenant in TENANT_LIMITS:
            lines.append(f"    limits: {TENANT_LIMITS[tenant]}")
    return "\n".join(lines) + "\n"


def start_main(logs: Path) -> Engine:
    tenants = logs / "tenants.yaml"
    tenants.write_text(tenants_yaml())
    redis = start_redis(logs / "redis.log")  # the tenants' windows, as a fleet shares them
    batch_root = logs / "batch-root"
    batch_root.mkdir()
    stack = on_free_ports(
        "main",
        [
            *("--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-gib", "1"),
            *("--api-key", f"{API_KEY},{OTHER_API_KEY}"),
            *("--tenants-file", str(tenants)),
            *("--limits-store", redis.url),
            *("--keepalive-time", str(SERVER_KEEPALIVE_SECONDS)),
            *("--keepalive-timeout", str(SERVER_KEEPALIVE_SECONDS)),
            *CHAT_FLAGS,
            *("--batch-root", str(batch_root)),
        ],
        logs / "service.log",
        service_module="tests.fault_injection",  # the real engine, failing on request
    )
    stack.start()
    return ReadyStack(stack, redis=redis, batch_root=batch_root)


def start_vllm(model_dir: Path) -> Engine:
    """vLLM's own OpenAI server on the same model directory, context length and chat flags,
    with prefix caching on (as ours has it) and its hits reported. Both of vLLM's servers run
    their worker inside the engine core, as ours does: the same tokens, and no core spinning
    on each step's result beside the other shard's tests."""
    STARTS.record("vllm")
    return VllmServer(
        VllmOpenAIServer(
            model_dir,
            MODEL,
            max_model_len=MAX_MODEL_LEN,
            kv_cache_gib=1,
            extra_args=["--enable-prompt-tokens-details", *CHAT_FLAGS],
            prefix_caching=True,
            worker_in_core=True,
        )
    )


def lora_flags(adapter_dirs: dict[str, Path]) -> list[str]:
    return ["--lora-modules", *(f"{name}={path}" for name, path in adapter_dirs.items())]


def adapter_root_of(adapter_dirs: dict[str, Path]) -> Path:
    """The LoRA stack's adapter root (empty at start), beside the adapters given at start."""
    return next(iter(adapter_dirs.values())).parent / "root"


def start_lora(adapter_dirs: dict[str, Path], logs: Path) -> Engine:
    """No chat flags: chat through an adapter and the tool choices that need a parser are
    checked on it too. Envoy shows its routing keys (--debug-headers). Adapters also come and
    go at runtime (an adapter root, load calls for the operator key)."""
    root = adapter_root_of(adapter_dirs)
    root.mkdir(exist_ok=True)
    stack = on_free_ports(
        "lora",
        [
            *SMALL_ENGINE,
            *("--served-model-name", LORA_MODEL),
            *lora_flags(adapter_dirs),
            *("--max-loras", "2"),
            *ADAPTER_TARGETS,
            *("--adapter-root", str(root), "--enable-adapter-loading"),
            *("--operator-api-key", OPERATOR_KEY, "--adapter-drain-seconds", "120"),
            *LORA_RUNTIME_ARGS,
        ],
        logs / "lora-service.log",
        envoy_args=["--debug-headers"],
    )
    stack.start()
    return ReadyStack(stack)


def start_vllm_lora(model_dir: Path, adapter_dirs: dict[str, Path]) -> Engine:
    """vLLM's own OpenAI server on the same model, name, context length, adapters and LoRA
    target modules."""
    STARTS.record("vllm-lora")
    return VllmServer(
        VllmOpenAIServer(
            model_dir,
            LORA_MODEL,
            max_model_len=512,
            kv_cache_gib=1,
            extra_args=[
                *("--enable-lora", "--max-loras", "2", *lora_flags(adapter_dirs)),
                *("--lora-target-modules", *ADAPTER_MODULES),
            ],
            worker_in_core=True,
        )
    )


def start_vlm(vlm_dir: Path, logs: Path) -> Engine:
    stack = on_free_ports(
        "vlm",
        [
            *("--model", str(vlm_dir), "--served-model-name", VLM_MODEL),
            *SMALL_ENGINE,
            *VLM_MEDIA_FLAGS,
            *("--max-media-bytes", str(VLM_MAX_MEDIA_BYTES)),
            *("--media-fetch-timeout", str(VLM_FETCH_TIMEOUT_SECONDS)),
        ],
        logs / "vlm-service.log",
        env={"LOG_FORMAT": "json"},
    )
    stack.start()
    return ReadyStack(stack)


def start_vllm_vlm(vlm_dir: Path) -> Engine:
    """vLLM's own OpenAI server on the tiny VLM with the same context and media settings."""
    STARTS.record("vllm-vlm")
    return VllmServer(
        VllmOpenAIServer(
            vlm_dir,
            VLM_MODEL,
            max_model_len=512,
            kv_cache_gib=1,
            extra_args=VLM_MEDIA_FLAGS,
            prefix_caching=True,
            worker_in_core=True,
        )
    )


def pinned_replica(
    engine: str, core: int, log: Path, service_args: list[str], env: dict[str, str] | None = None
) -> TestStack:
    """A replica of the small engine on one core, started without Envoy. Each replica of a
    pair gets a core of its own: vLLM's automatic binding would put both on the same one, and
    one would starve."""
    replica = TestStack(
        grpc_port=free_port(),
        service_args=[
            *SMALL_ENGINE,
            *("--cpu-cores", str(core)),
            *("--metrics-port", str(free_port())),
            *service_args,
        ],
        env=env,
        service_log=log,
        engine=engine,
    )
    replica.start(with_envoy=False)
    return replica


def start_fleet(logs: Path) -> Engine:
    """No adapters: on vLLM's CPU build a replica that can load them runs its base-model
    calls 1.6-3.5 times slower (bench.adapter_root_cost), and the routing tests are base-model
    calls (tests/test_fleet_adapters.py has a pair of its own)."""
    receiver = OtlpReceiver()
    replicas = [
        pinned_replica(
            "fleet",
            core,
            logs / f"fleet-replica-{core}.log",
            ["--otlp-traces-endpoint", receiver.endpoint],
            TRACE_BATCH_ENV,
        )
        for core in range(2)
    ]
    return FleetReplicas(replicas, receiver)


def start_small(model_dir: Path, logs: Path) -> Engine:
    variant = with_bos_tokenizer(model_dir, logs / "bos-model")
    stack = on_free_ports(
        "small",
        [
            *SMALL_ENGINE,
            *("--model", str(variant), "--served-model-name", BOS_MODEL),
            "--log-prompts",
            *("--max-num-seqs", str(SMALL_BATCH), "--scheduling-policy", "priority"),
            *("--max-num-queued-reqs", str(SMALL_QUEUED_REQS)),
            *("--max-num-queued-tokens", str(SMALL_QUEUED_TOKENS)),
            # A drain ends when the streams in flight end; the grace only bounds a stuck one.
            *("--shutdown-grace", "60"),
        ],
        logs / "small-service.log",
        # vLLM's automatic binding, whatever the shard sets for its engines.
        env={"LOG_FORMAT": "json", CPU_BIND_ENV: "auto"},
    )
    health = HealthWatch(stack.grpc_target).start()
    stack.start()
    return SmallStack(stack, health)


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return prepare_default_model()


@pytest.fixture(scope="session")
def vlm_dir(model_dir: Path) -> Path:
    return prepare_tiny_vlm()


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def adapter_dirs(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: build_adapter(model_dir, root / name, seed) for name, seed in ADAPTER_SEEDS.items()
    }


# What the builders need that fixtures make: made in the test's thread (fixtures are not
# thread-safe), before the builders run side by side.
BUILD_INPUTS: dict[str, object] = {}


def model_input() -> Path:
    return BUILD_INPUTS["model_dir"]  # type: ignore[return-value]


def adapters_input() -> dict[str, Path]:
    return BUILD_INPUTS["adapter_dirs"]  # type: ignore[return-value]


def logs_input() -> Path:
    return BUILD_INPUTS["logs"]  # type: ignore[return-value]


def vlm_input() -> Path:
    return BUILD_INPUTS["vlm_dir"]  # type: ignore[return-value]


SHARED = SharedEngines(
    builders={
        "main": lambda: start_main(logs_input()),
        "vllm": lambda: start_vllm(model_input()),
        "lora": lambda: start_lora(adapters_input(), logs_input()),
        "vllm-lora": lambda: start_vllm_lora(model_input(), adapters_input()),
        "fleet": lambda: start_fleet(logs_input()),
        "small": lambda: start_small(model_input(), logs_input()),
        "vlm": lambda: start_vlm(vlm_input(), logs_input()),
        "vllm-vlm": lambda: start_vllm_vlm(vlm_input()),
    },
    groups=SHARED_GROUPS,
    # The small engine starts beside the fleet's replicas: its placement (vLLM's automatic
    # binding) then shows the sharing.
    requires={"small": frozenset({"fleet"})},
    # The adapter pair takes vLLM's server's place (memory: see SHARED_GROUPS).
    successors={"vllm": frozenset({"lora", "vllm-lora"})},
)


@pytest.fixture(scope="session")
def shared_engines(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SharedEngines]:
    BUILD_INPUTS.update(model_dir=model_dir, logs=tmp_path_factory.mktemp("engines"))
    try:
        yield SHARED
    finally:
        SHARED.stop_all()


# The test being set up: a session fixture's request names the session, not the test.
CURRENT_TEST: list[str] = [""]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    CURRENT_TEST[0] = item.nodeid


def shared(request: pytest.FixtureRequest, name: str) -> Engine:
    test_id = CURRENT_TEST[0]
    shard = os.environ.get(SHARD_ENV)
    if not may_start(shard, name):
        pytest.fail(
            f"{test_id} needs the shared engine {name!r}, which the {shard!r} shard does not "
            "start: its module belongs in the shard that does (tests/shards.py)"
        )
    engines: SharedEngines = request.getfixturevalue("shared_engines")
    # The adapters are made with the session's first engines (their builders may start
    # between two tests, where no fixture can be made).
    if {"lora", "vllm-lora"} & engines.still_needed(test_id):
        BUILD_INPUTS["adapter_dirs"] = request.getfixturevalue("adapter_dirs")
    if {"vlm", "vllm-vlm"} & engines.still_needed(test_id):
        BUILD_INPUTS["vlm_dir"] = request.getfixturevalue("vlm_dir")
    return engines.get(name, test_id)


@pytest.fixture(scope="session")
def stack(request: pytest.FixtureRequest) -> TestStack:
    engine = shared(request, "main")
    assert isinstance(engine, ReadyStack)
    return engine.stack


@pytest.fixture(scope="session")
def limits_redis(request: pytest.FixtureRequest) -> RedisServer:
    """The Redis server the default stack keeps its tenants' windows in."""
    engine = shared(request, "main")
    assert isinstance(engine, ReadyStack) and engine.redis is not None
    return engine.redis


@pytest.fixture(scope="session")
def batch_root(request: pytest.FixtureRequest) -> Path:
    """The default stack's batch root."""
    engine = shared(request, "main")
    assert isinstance(engine, ReadyStack) and engine.batch_root is not None
    return engine.batch_root


@pytest.fixture(scope="session")
def vllm_server(request: pytest.FixtureRequest) -> str:
    engine = shared(request, "vllm")
    assert isinstance(engine, VllmServer)
    return engine.server.base_url


@pytest.fixture(scope="session")
def lora_stack(request: pytest.FixtureRequest) -> TestStack:
    engine = shared(request, "lora")
    assert isinstance(engine, ReadyStack)
    return engine.stack


@pytest.fixture(scope="session")
def vllm_lora_server(request: pytest.FixtureRequest) -> str:
    engine = shared(request, "vllm-lora")
    assert isinstance(engine, VllmServer)
    return engine.server.base_url


@pytest.fixture(scope="session")
def fleet_replicas(request: pytest.FixtureRequest) -> FleetReplicas:
    engine = shared(request, "fleet")
    assert isinstance(engine, FleetReplicas)
    return engine


@pytest.fixture(scope="session")
def small_stack(request: pytest.FixtureRequest) -> SmallStack:
    engine = shared(request, "small")
    assert isinstance(engine, SmallStack)
    return engine


@pytest.fixture(scope="session")
def vlm_stack(request: pytest.FixtureRequest) -> TestStack:
    engine = shared(request, "vlm")
    assert isinstance(engine, ReadyStack)
    return engine.stack


@pytest.fixture(scope="session")
def vllm_vlm_server(request: pytest.FixtureRequest) -> str:
    engine = shared(request, "vllm-vlm")
    assert isinstance(engine, VllmServer)
    return engine.server.base_url


@pytest.fixture(scope="session")
def rest(stack: TestStack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.base_url, timeout=120, headers=AUTH_HEADERS) as client:
        yield client


@pytest.fixture(scope="session")
def grpc_stub(stack: TestStack) -> Iterator[completions_pb2_grpc.CompletionServiceStub]:
    with grpc.insecure_channel(stack.grpc_target) as channel:
        yield completions_pb2_grpc.CompletionServiceStub(channel)


@pytest.fixture(scope="session")
def openai_client(stack: TestStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v2", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="session")
def metrics_url(stack: TestStack) -> str:
    return stack.metrics_url


def module_rank(item: pytest.Item) -> int:
    name = item.path.name
    if name in FIRST_MODULES:
        return FIRST_MODULES.index(name) - len(FIRST_MODULES)
    return LATE_MODULES.index(name) + 1 if name in LATE_MODULES else 0


# Work a module declares as `background()` that waits more than it computes (a resolver on the
# network): started when the session's tests are known, its result handed to the module's
# tests by the `background_result` fixture, so that the wait overlaps the other tests.
BACKGROUND = ThreadPoolExecutor(max_workers=2, thread_name_prefix="background")
BACKGROUND_JOBS: dict[Path, Future[object]] = {}


def start_background_work(items: list[pytest.Item]) -> None:
    for module in {item.module for item in items if isinstance(item, pytest.Function)}:
        work = getattr(module, "background", None)
        if callable(work) and module.__file__ is not None:
            BACKGROUND_JOBS[Path(module.__file__)] = BACKGROUND.submit(work)


@pytest.fixture(scope="module")
def background_result(request: pytest.FixtureRequest) -> object:
    return BACKGROUND_JOBS[request.path].result()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=module_rank)  # stable: file order within a module, and among the rest
    if not config.option.collectonly:
        start_background_work(items)
    SHARED.plan(
        [
            (
                item.nodeid,
                frozenset(SHARED_FIXTURES[f] for f in item.fixturenames if f in SHARED_FIXTURES),
            )
            for item in items
        ]
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    yield
    SHARED.release_after(nextitem.nodeid if nextitem else None)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for line in STARTS.summary():
        terminalreporter.write_line(line)
    for name, (count, budget) in STARTS.over_budget().items():
        terminalreporter.write_line(
            f"engine {name!r} started {count} times, over its budget of {budget}", red=True
        )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if STARTS.over_budget() and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
