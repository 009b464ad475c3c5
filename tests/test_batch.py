"""Batch jobs on the default stack, through Envoy (LLM Engine's REST shapes) and gRPC: inline
and file input, completion and chat lines, each equal to the synchronous answer at temperature
0; a line over the context failed while the rest complete; a bad line refused at create naming
its index and field; interactive calls beside a job served, and a cancel leaving partial output;
another tenant getting 404; paths outside the batch root refused before anything is read or
written; the watch ending on the final status."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from llmcompletions.v2 import completions_pb2_grpc
from llmcompletions.v2.completions_pb2 import WatchBatchCompletionRequest

from tests.conftest import AUTH_HEADERS, GRPC_AUTH, MAX_MODEL_LEN, MODEL, TENANT_KEYS
from tests.metrics import sample
from tests.processes import TestStack

COMPLETION_LINES = [
    {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0},
    {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "logprobs": 2},
]
CHAT_LINES = [
    {
        "messages": [{"role": "user", "content": "Name a colour."}],
        "max_completion_tokens": 8,
        "temperature": 0,
    }
]
# The batch metrics one job of the default caller moves.
COUNTED = {
    "llmcompletions_batch_jobs_total": {"status": "completed"},
    "llmcompletions_batch_lines_total": {"result": "completed"},
    "llmcompletions_batch_tokens_total": {"tenant": "", "kind": "completion"},
}
# Fields that differ between any two answers: their ids and times.
VOLATILE = ("id", "created")
JOB_SECONDS = 300


def job_request(content: list[dict[str, Any]] | None = None, **fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model_config": {"model": MODEL}, "labels": {"team": "tests"}}
    if content is not None:
        body["content"] = content
    return {**body, **fields}


def create(rest: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    response = rest.post("/v2/batch-completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def wait_done(rest: httpx.Client, job_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + JOB_SECONDS
    while time.monotonic() < deadline:
        response = rest.get(f"/v2/batch-completions/{job_id}")
        assert response.status_code == 200, response.text
        job = response.json()["job"]
        if job["status"] in ("completed", "failed", "cancelled"):
            return job
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} did not end within {JOB_SECONDS} s")


def stable(answer: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in answer.items() if key not in VOLATILE}


def assert_same_answer(batch: Any, sync: Any, where: str = "") -> None:
    """The same JSON, but for log-probabilities, which differ in the last digits with the
    batch a line ran in (the same tokens come out; greedy text is equal)."""
    if isinstance(sync, dict):
        assert isinstance(batch, dict) and batch.keys() == sync.keys(), where
        for key, value in sync.items():
            assert_same_answer(batch[key], value, f"{where}.{key}")
    elif isinstance(sync, list):
        assert isinstance(batch, list) and len(batch) == len(sync), where
        for index, (mine, theirs) in enumerate(zip(batch, sync, strict=True)):
            assert_same_answer(mine, theirs, f"{where}[{index}]")
    elif isinstance(sync, float):
        assert math.isclose(batch, sync, rel_tol=1e-3, abs_tol=1e-3), (where, batch, sync)
    else:
        assert batch == sync, (where, batch, sync)


def sync_answer(rest: httpx.Client, kind: str, line: dict[str, Any]) -> dict[str, Any]:
    path = "/v2/chat/completions" if kind == "chat" else "/v2/completions"
    response = rest.post(path, json={"model": MODEL, **line})
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def batch_stub(stack: TestStack) -> Iterator[completions_pb2_grpc.BatchCompletionServiceStub]:
    with grpc.insecure_channel(stack.grpc_target) as channel:
        yield completions_pb2_grpc.BatchCompletionServiceStub(channel)


def test_inline_lines_answer_as_the_synchronous_calls_do(
    rest: httpx.Client, batch_root: Path, metrics_url: str
) -> None:
    lines = [*COMPLETION_LINES, *CHAT_LINES]
    before = {name: sample(metrics_url, name, **labels) for name, labels in COUNTED.items()}
    job = create(rest, job_request(lines, output_data_path="inline/out.json"))
    assert job["status"] in ("queued", "running") and job["job_id"].startswith("batch-")
    assert job["metadata"] == {"team": "tests"} and job["model_config"]["model"] == MODEL
    done = wait_done(rest, job["job_id"])
    assert done["status"] == "completed", done
    assert done["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
    assert done["completed_at"]
    output = json.loads((batch_root / "inline" / "out.json").read_text())
    kinds = ["completion"] * len(COMPLETION_LINES) + ["chat"] * len(CHAT_LINES)
    assert len(output) == len(lines)
    for item, kind, line in zip(output, kinds, lines, strict=True):
        assert_same_answer(stable(item), stable(sync_answer(rest, kind, line)))
    after = {name: sample(metrics_url, name, **labels) for name, labels in COUNTED.items()}
    assert after["llmcompletions_batch_jobs_total"] == before["llmcompletions_batch_jobs_total"] + 1
    lines_done = "llmcompletions_batch_lines_total"
    assert after[lines_done] == before[lines_done] + len(lines)
    generated = sum(item["usage"]["completion_tokens"] for item in output)
    tokens = "llmcompletions_batch_tokens_total"
    assert after[tokens] == before[tokens] + generated


def test_a_jsonl_file_runs_as_its_lines(rest: httpx.Client, batch_root: Path) -> None:
    (batch_root / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in CHAT_LINES))
    job = create(rest, job_request(input_data_path="in.jsonl", output_data_path="file-out.json"))
    assert job["input_data_path"] == "in.jsonl"
    assert wait_done(rest, job["job_id"])["status"] == "completed"
    (item,) = json.loads((batch_root / "file-out.json").read_text())
    assert_same_answer(stable(item), stable(sync_answer(rest, "chat", CHAT_LINES[0])))


def test_a_line_over_the_context_fails_alone(rest: httpx.Client, batch_root: Path) -> None:
    too_long = {"prompt": "word " * (MAX_MODEL_LEN + 10), "max_tokens": 4}
    lines = [COMPLETION_LINES[0], too_long, COMPLETION_LINES[1]]
    job = create(rest, job_request(lines, output_data_path="context.json"))
    done = wait_done(rest, job["job_id"])
    assert done["status"] == "completed"
    assert done["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    output = json.loads((batch_root / "context.json").read_text())
    assert output[1]["error"]["status_code"] == 400
    assert "choices" in output[0] and "choices" in output[2]


def test_a_bad_line_is_refused_at_create_naming_its_index_and_field(
    rest: httpx.Client, batch_root: Path
) -> None:
    lines = [COMPLETION_LINES[0], {"prompt": "Hi", "temperature": 7}]
    response = rest.post(
        "/v2/batch-completions", json=job_request(lines, output_data_path="bad.json")
    )
    assert response.status_code == 422, response.text
    (violation,) = response.json()["detail"]
    assert violation["loc"] == ["body", "content", 1, "temperature"]
    assert not (batch_root / "bad.json").exists()


@pytest.mark.parametrize(
    "fields",
    [
        {"output_data_path": "/etc/out.json", "content": CHAT_LINES},
        {"output_data_path": "../escape.json", "content": CHAT_LINES},
        {"output_data_path": "ok.json", "input_data_path": "/etc/passwd"},
        {"output_data_path": "s3://bucket/out.json", "content": CHAT_LINES},
    ],
    ids=["absolute output", "relative escape", "input outside", "another scheme"],
)
def test_paths_outside_the_root_are_refused_before_anything_is_read_or_written(
    rest: httpx.Client, batch_root: Path, fields: dict[str, Any]
) -> None:
    response = rest.post("/v2/batch-completions", json=job_request(**fields))
    assert response.status_code == 422, response.text
    assert "batch root" in response.text
    assert not (batch_root.parent / "escape.json").exists()


def test_model_config_asking_what_the_engine_cannot_give_is_refused(rest: httpx.Client) -> None:
    body = job_request(CHAT_LINES, output_data_path="x.json")
    body["model_config"].update(checkpoint_path="s3://other", max_context_length=10**6)
    body["data_parallelism"] = 65  # 1 to 64
    response = rest.post("/v2/batch-completions", json=body)
    assert response.status_code == 422, response.text
    locs = {tuple(violation["loc"]) for violation in response.json()["detail"]}
    assert {
        ("body", "model_config", "checkpoint_path"),
        ("body", "model_config", "max_context_length"),
        ("body", "data_parallelism"),
    } <= locs


def test_interactive_calls_beside_a_job_are_served_and_a_cancel_leaves_partial_output(
    rest: httpx.Client, batch_root: Path
) -> None:
    """While the job runs, interactive calls come (its lines beyond a 32nd of its window stop
    for them, and run again): none is refused. Then a cancel leaves the output partial."""
    lines = [{"prompt": f"Story {i}:", "max_tokens": 200, "ignore_eos": True} for i in range(40)]
    job = create(rest, job_request(lines, output_data_path="cancelled.json"))
    time.sleep(1)
    interactive = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8}
    with ThreadPoolExecutor(6) as callers:
        answers = list(
            callers.map(lambda _: rest.post("/v2/completions", json=interactive), range(6))
        )
    assert [answer.status_code for answer in answers] == [200] * 6, answers[0].text
    time.sleep(1)
    response = rest.post(f"/v2/batch-completions/{job['job_id']}/actions/cancel", json={})
    assert response.status_code == 200, response.text
    assert response.json() == {"success": True}
    done = wait_done(rest, job["job_id"])
    assert done["status"] == "cancelled"
    output = json.loads((batch_root / "cancelled.json").read_text())
    assert len(output) == len(lines)
    not_run = [item for item in output if item.get("error", {}).get("status_code") == 499]
    assert not_run, "a cancel within seconds leaves lines not run"
    ran = [item for item in output if "choices" in item]
    assert len(ran) == done["request_counts"]["completed"]


def test_another_tenant_gets_not_found(rest: httpx.Client, stack: TestStack) -> None:
    headers = {"Authorization": f"Bearer {TENANT_KEYS['team-a']}"}
    mine = create(rest, job_request(CHAT_LINES, output_data_path="tenant.json"))
    with httpx.Client(base_url=stack.base_url, headers=headers, timeout=60) as other:
        assert other.get(f"/v2/batch-completions/{mine['job_id']}").status_code == 404
        cancel = other.post(f"/v2/batch-completions/{mine['job_id']}/actions/cancel", json={})
        assert cancel.status_code == 404
        listed = other.get("/v2/batch-completions").json()["jobs"]
        assert mine["job_id"] not in {job["job_id"] for job in listed}
    assert mine["job_id"] in {
        job["job_id"] for job in rest.get("/v2/batch-completions").json()["jobs"]
    }


def test_no_key_no_job(stack: TestStack) -> None:
    response = httpx.post(
        f"{stack.base_url}/v2/batch-completions",
        json=job_request(CHAT_LINES, output_data_path="nokey.json"),
        timeout=60,
    )
    assert response.status_code == 401


def test_the_watch_ends_on_the_final_status(
    rest: httpx.Client, batch_stub: completions_pb2_grpc.BatchCompletionServiceStub
) -> None:
    job = create(rest, job_request(COMPLETION_LINES, output_data_path="watched.json"))
    request = WatchBatchCompletionRequest(batch_completion_id=job["job_id"])
    seen = list(batch_stub.WatchBatchCompletion(request, metadata=GRPC_AUTH, timeout=JOB_SECONDS))
    assert seen[-1].job.status == "completed"
    assert seen[-1].job.request_counts.completed == len(COMPLETION_LINES)
    assert all(event.job.status in ("queued", "running") for event in seen[:-1])


def test_priority_updates_and_keys_llm_engine_sends_are_taken(
    rest: httpx.Client, stack: TestStack
) -> None:
    """LLM Engine's clients send the key as HTTP basic auth (the key as the user name) and as
    x-api-key."""
    api_key = AUTH_HEADERS["Authorization"].removeprefix("Bearer ")
    with httpx.Client(base_url=stack.base_url, auth=(api_key, ""), timeout=60) as basic:
        job = create(basic, job_request(CHAT_LINES, output_data_path="basic.json"))
    with httpx.Client(base_url=stack.base_url, headers={"x-api-key": api_key}) as keyed:
        response = keyed.post(
            f"/v2/batch-completions/{job['job_id']}",
            json={"job_id": job["job_id"], "priority": "low"},
        )
    assert response.status_code == 200, response.text
    assert response.json()["priority"] == "low"
    assert rest.get(f"/v2/batch-completions/{job['job_id']}").json()["job"]["priority"] == "low"
