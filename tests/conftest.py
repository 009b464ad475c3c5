"""One running stack (the real engine on the default model, and a real Envoy) per test session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from llmcompletions.v2 import completions_pb2_grpc
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from bench.servers import VllmOpenAIServer
from service.model.default_model import DEFAULT_SERVED_MODEL_NAME, prepare_default_model
from tests.processes import TestStack, free_port

MODEL = DEFAULT_SERVED_MODEL_NAME
MAX_MODEL_LEN = 2048
API_KEY = "test-key-0123456789"
# A second caller of the same server (it accepts both keys): cancels are scoped by key.
OTHER_API_KEY = "other-key-9876543210"
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


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return prepare_default_model()


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def stack(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestStack]:
    running = TestStack(
        grpc_port=free_port(),
        http_port=free_port(),
        admin_port=free_port(),
        service_args=[
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--kv-cache-gib",
            "1",
            "--api-key",
            f"{API_KEY},{OTHER_API_KEY}",
            "--metrics-port",
            str(free_port()),
            "--keepalive-time",
            str(SERVER_KEEPALIVE_SECONDS),
            "--keepalive-timeout",
            str(SERVER_KEEPALIVE_SECONDS),
            *CHAT_FLAGS,
        ],
        service_module="tests.fault_injection",  # the real engine, failing on request
        service_log=tmp_path_factory.mktemp("stack") / "service.log",
    )
    with running.running(ENGINE_START_TIMEOUT):
        yield running


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
    port = stack.service_args[stack.service_args.index("--metrics-port") + 1]
    return f"http://127.0.0.1:{port}/metrics"


@pytest.fixture(scope="session")
def vllm_server(model_dir: Path) -> Iterator[str]:
    """vLLM's own OpenAI server on the same model directory, context length and chat flags,
    with prefix caching on (as ours has it) and its hits reported."""
    server = VllmOpenAIServer(
        model_dir,
        MODEL,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_gib=1,
        extra_args=["--enable-prompt-tokens-details", *CHAT_FLAGS],
        prefix_caching=True,
    )
    try:
        server.wait_ready()
        yield server.base_url
    finally:
        server.stop()
