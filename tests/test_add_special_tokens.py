"""`add_special_tokens` on a model whose tokenizer adds a BOS token.

The default model's tokenizer adds no special tokens, so this module serves a variant of it
(the same weights; a tokenizer that prepends <|endoftext|>) from a second service process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from llmcompletions.v2 import completions_pb2_grpc

from facade.stack import Stack
from tests.conftest import ENGINE_START_TIMEOUT, free_port
from tests.helpers import grpc_complete

BOS_ID = 0
BOS_MODEL = "smollm2-with-bos"


def with_bos_tokenizer(model_dir: Path, target: Path) -> Path:
    target.mkdir()
    for item in model_dir.iterdir():
        if item.name != "tokenizer.json":
            os.symlink(item, target / item.name)
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {
            "<|endoftext|>": {"id": "<|endoftext|>", "ids": [BOS_ID], "tokens": ["<|endoftext|>"]}
        },
    }
    (target / "tokenizer.json").write_text(json.dumps(tokenizer))
    return target


@pytest.fixture(scope="module")
def bos_stub(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[completions_pb2_grpc.CompletionServiceStub]:
    variant = with_bos_tokenizer(model_dir, tmp_path_factory.mktemp("bos") / "model")
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "service",
        "serve",
        "--port",
        str(port),
        "--model",
        str(variant),
        "--served-model-name",
        BOS_MODEL,
        "--max-model-len",
        "512",
        "--kv-cache-gib",
        "0.25",
    ]
    log = (tmp_path_factory.getbasetemp() / "bos-service.log").open("ab")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    probe = Stack(grpc_port=port)
    probe.processes = [process]
    try:
        probe.wait_ready_service(ENGINE_START_TIMEOUT)
        with grpc.insecure_channel(probe.grpc_target) as channel:
            yield completions_pb2_grpc.CompletionServiceStub(channel)
    finally:
        probe.stop()
        shutil.rmtree(variant, ignore_errors=True)


def test_add_special_tokens_adds_the_bos_token(
    bos_stub: completions_pb2_grpc.CompletionServiceStub,
) -> None:
    request = {
        "model": BOS_MODEL,
        "prompt": "Hello world",
        "max_tokens": 1,
        "echo": True,
        "logprobs": 0,
    }
    (with_bos,) = grpc_complete(bos_stub, **request)
    (default,) = grpc_complete(bos_stub, **{**request, "add_special_tokens": True})
    (without,) = grpc_complete(bos_stub, **{**request, "add_special_tokens": False})
    assert with_bos.usage.prompt_tokens == default.usage.prompt_tokens
    assert with_bos.usage.prompt_tokens == without.usage.prompt_tokens + 1
    assert with_bos.choices[0].logprobs.tokens[0] == "<|endoftext|>"
    assert without.choices[0].logprobs.tokens[0] != "<|endoftext|>"
