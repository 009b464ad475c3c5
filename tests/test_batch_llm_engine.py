"""LLM Engine's own Python client (`scale-llm-engine`, in a venv of its own: it pins openai<2)
runs against the default stack's Envoy unmodified: it creates a batch job with
`Completion.batch_create(..., use_v2=True)` (its body carries every unset field as null, and
its key as HTTP basic auth and x-api-key), reads it, and cancels it."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import API_KEY, MODEL
from tests.processes import TestStack

CLIENT_PYTHON = (
    Path(__file__).resolve().parents[1] / ".venv" / "tools" / "llmengine" / "bin" / "python"
)
LINES = 24
CLIENT_SCRIPT = """
import json, sys
from llmengine import Completion, CreateBatchCompletionsModelConfig, FilteredCompletionV2Request

model, lines = sys.argv[1], int(sys.argv[2])
content = [
    FilteredCompletionV2Request(prompt=f"Story {i}:", max_tokens=200, ignore_eos=True)
    for i in range(lines)
]
job = Completion.batch_create(
    output_data_path="llm-engine/out.json",
    model_config=CreateBatchCompletionsModelConfig(model=model, labels={}),
    content=content,
    labels={"client": "llm-engine"},
    use_v2=True,
)
read = Completion.get_batch_completion(job.job_id)
cancelled = Completion.cancel_batch_completion(job.job_id)
after = Completion.get_batch_completion(job.job_id)
print(json.dumps({"created": job.dict(), "read": read, "cancelled": cancelled, "after": after},
                 default=str))
"""


def test_llm_engines_client_creates_reads_and_cancels_a_job(
    stack: TestStack, batch_root: Path
) -> None:
    if not CLIENT_PYTHON.exists():
        pytest.fail(f"{CLIENT_PYTHON} is missing: `make test` installs it (make llmengine)")
    environment = {
        **os.environ,
        "LLM_ENGINE_BASE_PATH": f"{stack.base_url}/",
        "SCALE_API_KEY": API_KEY,
        "LLM_ENGINE_DISABLE_VERSION_CHECK": "1",  # else it asks PyPI on import
    }
    run = subprocess.run(
        [str(CLIENT_PYTHON), "-c", CLIENT_SCRIPT, MODEL, str(LINES)],
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.splitlines()[-1])
    created, read, after = seen["created"], seen["read"]["job"], seen["after"]["job"]
    assert created["status"] in ("queued", "running")
    assert created["metadata"] == {"client": "llm-engine"}
    assert read["job_id"] == created["job_id"] and read["model_config"]["model"] == MODEL
    assert seen["cancelled"] == {"success": True}
    assert after["status"] == "cancelled"
    output = json.loads((batch_root / "llm-engine" / "out.json").read_text())
    assert len(output) == LINES
