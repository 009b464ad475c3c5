"""service/api/batch and its transport: a job's paths stay inside the batch root, its lines are
read and checked as the synchronous calls check them, its request asks only for what the running
engine is, its record survives a torn write, its runner keeps a window of lines in flight and
ends (completed, cancelled, expired, shut down, resumed) with the output file LLM Engine reads,
only its owner sees it; a line's call carries this process's token, its refusal becomes the REST
error or a retry, and LLM Engine's ways of presenting a key are taken."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import json_format
from google.protobuf.message import Message
from llmcompletions.v2.completions_pb2 import CreateBatchCompletionRequest

from service.api.batch.job_request import EngineFacts, check_job_request
from service.api.batch.jobs import BatchJobs, JobNotFoundError
from service.api.batch.lines import MAX_REPORTED, checked_lines, read_input_file
from service.api.batch.paths import confined
from service.api.batch.runner import Owner, RetryLaterError, Runner
from service.api.batch.store import CANCEL_MARKER, Job, JobStore, record_line
from service.api.errors import FieldViolation, Loc, RequestValidationError
from service.api.validation import Violations
from service.settings import BatchSettings
from service.transport.auth import basic_user, presented_key
from service.transport.batch_lines import (
    LINE_OWNER_HEADER,
    LINE_TOKEN,
    LINE_TOKEN_HEADER,
    line_owner,
    refusal,
)
from service.transport.rest_bridge import error_metadata

OWNER = Owner("key-owner", "", "")
STRANGER = Owner("key-stranger", "", "")
ENGINE = EngineFacts(max_model_len=2048, quantization=None)
WAIT_SECONDS = 5.0

Caller = Callable[[str, dict[str, Any], Owner], Awaitable[dict[str, Any]]]


def make_job(root: Path, total: int, job_id: str = "batch-a", **fields: Any) -> Job:
    now = time.time()
    job = Job(
        job_id=job_id,
        owner=OWNER.principal,
        tenant=OWNER.tenant,
        key_id=OWNER.key_id,
        status="queued",
        input_data_path=None,
        output_data_path="out.json",
        output_file=str(root / "out.json"),
        model_config={"model": "m"},
        priority=None,
        labels={},
        created_at=now,
        expires_at=now + 3600,
        max_runtime_sec=3600,
        total=total,
        kinds=["completion"] * total,
    )
    return replace(job, **fields)


def stored_job(root: Path, total: int, **fields: Any) -> tuple[JobStore, Job]:
    store = JobStore(root)
    job = make_job(root, total, **fields)
    store.create(job, [{"prompt": str(index), "model": "m"} for index in range(total)])
    return store, job


def output_of(job: Job) -> list[Any]:
    return json.loads(Path(job.output_file).read_text())


def answer(body: dict[str, Any]) -> dict[str, Any]:
    return {"response": {"text": body.get("prompt", "chat")}}


async def run_to_end(runner: Runner, job: Job) -> None:
    runner.start(job)
    await asyncio.wait_for(asyncio.shield(runner.tasks[job.job_id]), WAIT_SECONDS)


async def never(event: asyncio.Event) -> dict[str, Any]:
    await event.wait()
    raise AssertionError("this line was meant to be stopped")


def accept_all(kind: str, message: Message) -> None:
    pass


# paths


def test_a_relative_path_and_an_absolute_one_inside_the_root_are_taken(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    found = Violations()
    inside = str(root.resolve() / "x.json")
    assert confined(root, (), "out/x.json", "output_data_path", found) == str(
        root.resolve() / "out/x.json"
    )
    assert confined(root, (), str(root / "x.json"), "output_data_path", found) == inside
    assert confined(root, (), f"file://{root}/x.json", "output_data_path", found) == inside
    assert found.items == []


def test_a_bucket_path_is_taken_only_under_an_allowed_bucket_and_prefix() -> None:
    buckets = ("s3://jobs", "s3://shared/evals")
    found = Violations()
    for given in ("s3://jobs/in.jsonl", "s3://jobs/a/b.json", "s3://shared/evals/x.json"):
        assert confined(Path("/nonexistent"), buckets, given, "input_data_path", found) == given
    assert found.items == []


@pytest.mark.parametrize(
    "given",
    [
        "s3://jobs",
        "s3://jobs/",
        "s3://jobsx/in.jsonl",
        "s3://other/in.jsonl",
        "s3://shared/in.jsonl",
        "s3://shared/evalsx/in.jsonl",
        "s3://shared/evals/../in.jsonl",
        "s3://jobs/a//b.json",
        "s3://jobs/./b.json",
        "s3://jobs/a\nb.json",
    ],
)
def test_a_bucket_path_outside_the_allowed_ones_is_refused_naming_the_field(given: str) -> None:
    found = Violations()
    buckets = ("s3://jobs", "s3://shared/evals")
    assert confined(Path("/nonexistent"), buckets, given, "output_data_path", found) is None
    assert [v.loc for v in found.items] == [("output_data_path",)]


@pytest.mark.parametrize(
    "given",
    [
        "OUTSIDE",
        "../x.json",
        "sub/../../x.json",
        "link/x.json",
        "s3://bucket/key.json",
        "http://x/out.json",
        "",
        "out\x00.json",
    ],
)
def test_a_path_leaving_the_root_or_not_a_local_file_is_refused_naming_the_field(
    tmp_path: Path, given: str
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (root / "link").symlink_to(elsewhere)
    given = given.replace("OUTSIDE", str(elsewhere / "x.json"))
    found = Violations()
    assert confined(root, (), given, "input_data_path", found) is None
    assert [v.loc for v in found.items] == [("input_data_path",)]


# lines


def test_an_input_file_is_read_as_a_json_list_or_as_jsonl(tmp_path: Path) -> None:
    limits = BatchSettings(root=tmp_path)
    requests = [{"prompt": "a"}, {"messages": [{"role": "user", "content": "b"}]}]
    listed = tmp_path / "list.json"
    listed.write_text(json.dumps(requests, indent=2))
    jsonl = tmp_path / "lines.jsonl"
    jsonl.write_text("".join(json.dumps(request) + "\n\n" for request in requests))
    assert read_input_file(str(listed), limits, "input_data_path") == requests
    assert read_input_file(str(jsonl), limits, "input_data_path") == requests


def test_an_input_file_too_large_or_neither_json_nor_jsonl_is_refused(tmp_path: Path) -> None:
    big = tmp_path / "big.jsonl"
    big.write_text('{"prompt": "a long enough line"}\n')
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_text('{"prompt": "a"}\nnot json\n')
    for path, limits in (
        (big, BatchSettings(root=tmp_path, max_input_bytes=10)),
        (garbage, BatchSettings(root=tmp_path)),
        (tmp_path / "absent.jsonl", BatchSettings(root=tmp_path)),
    ):
        with pytest.raises(RequestValidationError) as refused:
            read_input_file(str(path), limits, "input_data_path")
        assert [v.loc for v in refused.value.violations] == [("input_data_path",)]


def test_lines_take_the_jobs_model_unless_they_name_one_and_lose_their_nulls(
    tmp_path: Path,
) -> None:
    seen: list[tuple[str, Message]] = []
    requests = [
        {"prompt": "a", "model": None, "temperature": None, "stream": None},
        {"messages": [{"role": "user", "content": "b"}], "model": "adapter"},
    ]
    lines = checked_lines(
        requests, "m", ("content",), BatchSettings(root=tmp_path), lambda *call: seen.append(call)
    )
    assert [line.kind for line in lines] == ["completion", "chat"]
    assert lines[0].body == {"prompt": "a", "model": "m"}
    assert lines[1].body["model"] == "adapter"
    assert [kind for kind, _ in seen] == ["completion", "chat"]
    assert [message.model for _, message in seen] == ["m", "adapter"]


@pytest.mark.parametrize(
    ("requests", "loc"),
    [
        ([{"prompt": "a"}, {"prompt": "b", "stream": True}], ("content", 1, "stream")),
        ([{"prompt": "a"}, "just text"], ("content", 1)),
        ([{"input": "a"}], ("content", 0)),
        ([], ("content",)),
        ([{"prompt": "a"}] * 4, ("content",)),
    ],
)
def test_a_streamed_unknown_or_surplus_line_or_an_empty_job_is_refused(
    tmp_path: Path, requests: list[Any], loc: Loc
) -> None:
    with pytest.raises(RequestValidationError) as refused:
        checked_lines(
            requests, "m", ("content",), BatchSettings(root=tmp_path, max_lines=3), accept_all
        )
    assert [v.loc for v in refused.value.violations] == [loc]


def test_a_lines_own_validation_errors_are_reported_at_its_index(tmp_path: Path) -> None:
    def validate(kind: str, message: Message) -> None:
        if json_format.MessageToDict(message)["prompt"] == "bad":
            raise RequestValidationError([FieldViolation(("temperature",), "bad", "value_error")])

    with pytest.raises(RequestValidationError) as refused:
        checked_lines(
            [{"prompt": "ok"}, {"prompt": "bad"}],
            "m",
            ("input_data_path",),
            BatchSettings(root=tmp_path),
            validate,
        )
    assert [(v.loc, v.msg) for v in refused.value.violations] == [
        (("input_data_path", 1, "temperature"), "bad")
    ]


def test_checking_stops_once_max_reported_violations_are_found(tmp_path: Path) -> None:
    calls = []

    def validate(kind: str, message: Message) -> None:
        calls.append(kind)
        raise RequestValidationError([FieldViolation(("n",), "x", "value_error")])

    with pytest.raises(RequestValidationError) as refused:
        checked_lines(
            [{"prompt": "a"}] * (MAX_REPORTED + 10),
            "m",
            ("content",),
            BatchSettings(root=tmp_path),
            validate,
        )
    assert len(calls) == MAX_REPORTED
    assert len(refused.value.violations) == MAX_REPORTED


# job_request


def llm_engine_body() -> dict[str, Any]:
    """A job request as LLM Engine's client sends it: every unset field null."""
    return {
        "input_data_path": None,
        "output_data_path": "out.json",
        "content": [{"prompt": "a"}],
        "model_config": {
            "model": "m",
            "checkpoint_path": None,
            "num_shards": 1,
            "max_context_length": None,
            "seed": None,
            "response_role": None,
            "labels": {},
            "trust_remote_code": False,
        },
        "labels": {},
        "data_parallelism": 1,
        "max_runtime_sec": 86400,
        "priority": None,
        "tool_config": None,
        "cpus": None,
        "gpus": None,
        "memory": None,
        "gpu_type": None,
        "storage": None,
        "nodes_per_worker": None,
    }


def job_request_violations(body: dict[str, Any], engine: EngineFacts = ENGINE) -> list[Loc]:
    request = json_format.ParseDict(body, CreateBatchCompletionRequest())
    found = Violations()
    check_job_request(request, engine, found)
    return [v.loc for v in found.items]


def test_llm_engine_clients_job_request_asks_for_nothing_the_engine_lacks() -> None:
    assert job_request_violations(llm_engine_body()) == []
    within = llm_engine_body()
    within["model_config"].update(max_context_length=2048, quantize="awq", response_role=None)
    assert job_request_violations(within, replace(ENGINE, quantization="awq")) == []


@pytest.mark.parametrize(
    ("change", "loc"),
    [
        ({"model_config": {"checkpoint_path": "s3://b/ckpt"}}, ("model_config", "checkpoint_path")),
        ({"model_config": {"max_context_length": 4096}}, ("model_config", "max_context_length")),
        ({"model_config": {"quantize": "awq"}}, ("model_config", "quantize")),
        (
            {"model_config": {"gpu_memory_utilization": 0.9}},
            ("model_config", "gpu_memory_utilization"),
        ),
        ({"model_config": {"model": None}}, ("model_config", "model")),
        ({"gpus": 1}, ("gpus",)),
        ({"tool_config": {"name": "code_evaluator"}}, ("tool_config",)),
        ({"nodes_per_worker": 2}, ("nodes_per_worker",)),
        ({"data_parallelism": 0}, ("data_parallelism",)),
        ({"data_parallelism": 65}, ("data_parallelism",)),
        ({"max_runtime_sec": 0}, ("max_runtime_sec",)),
        ({"max_runtime_sec": 200000}, ("max_runtime_sec",)),
    ],
)
def test_a_job_request_asking_for_another_engine_or_hardware_is_refused_at_the_field(
    change: dict[str, Any], loc: Loc
) -> None:
    body = llm_engine_body()
    for name, value in change.items():
        if name == "model_config":
            body["model_config"].update(value)
        else:
            body[name] = value
    assert job_request_violations(body) == [loc]


# store


def test_a_job_is_stored_and_loaded_whole(tmp_path: Path) -> None:
    store, job = stored_job(tmp_path, 2, labels={"team": "a"}, priority="low")
    assert store.load(job.job_id) == job
    job.status, job.completed = "running", 1
    store.save(job)
    store.save_progress(job.job_id, 0, completed=1, failed=0)  # while it runs: its shards'
    assert store.load(job.job_id) == job
    assert store.lines(job.job_id) == [{"prompt": "0", "model": "m"}, {"prompt": "1", "model": "m"}]
    assert store.load("batch-absent") is None


def test_the_record_skips_a_torn_last_line_and_keeps_each_lines_last_result(
    tmp_path: Path,
) -> None:
    store, job = stored_job(tmp_path, 3)
    with store.open_record(job.job_id, 0) as record:
        record_line(record, 0, {"error": {"status_code": 500, "detail": "x"}})
        record_line(record, 1, {"response": {"text": "b"}})
        record_line(record, 0, {"response": {"text": "a"}})
        record.write('{"index": 2, "result": {"respo')
    assert store.results(job) == {
        0: {"response": {"text": "a"}},
        1: {"response": {"text": "b"}},
    }


def test_only_the_first_holder_holds_a_job(tmp_path: Path) -> None:
    store, job = stored_job(tmp_path, 1)
    with store.held(job.job_id, 0) as first, store.held(job.job_id, 0) as second:
        assert (first, second) == (True, False)
        with store.held(job.job_id, 1) as other_shard:
            assert other_shard
    with store.held(job.job_id, 0) as again:
        assert again


# runner


def test_a_job_runs_every_line_with_at_most_a_window_in_flight(tmp_path: Path) -> None:
    store, job = stored_job(tmp_path, 7)
    in_flight, most = 0, 0

    async def caller(kind: str, body: dict[str, Any], owner: Owner) -> dict[str, Any]:
        nonlocal in_flight, most
        assert (kind, owner) == ("completion", OWNER)
        in_flight += 1
        most = max(most, in_flight)
        await asyncio.sleep(0.01 * (int(body["prompt"]) % 3))
        in_flight -= 1
        return answer(body)

    asyncio.run(run_to_end(Runner(store, caller, window=2), job))
    assert most == 2
    ended = store.load(job.job_id)
    assert ended is not None
    assert (ended.status, ended.completed, ended.failed) == ("completed", 7, 0)
    assert ended.completed_at is not None
    assert output_of(job) == [{"text": str(index)} for index in range(7)]
    assert store.results(job) == {i: answer({"prompt": str(i)}) for i in range(7)}


def test_a_held_back_line_runs_again_and_an_erring_line_fails_alone(tmp_path: Path) -> None:
    store, job = stored_job(tmp_path, 3)
    error = {"error": {"status_code": 400, "detail": "bad line"}}
    tries: dict[str, int] = {}

    async def caller(kind: str, body: dict[str, Any], owner: Owner) -> dict[str, Any]:
        tries[body["prompt"]] = tries.get(body["prompt"], 0) + 1
        if body["prompt"] == "1" and tries["1"] <= 2:
            raise RetryLaterError(0.01)
        return error if body["prompt"] == "2" else answer(body)

    asyncio.run(run_to_end(Runner(store, caller, window=2), job))
    ended = store.load(job.job_id)
    assert ended is not None
    assert (ended.status, ended.completed, ended.failed) == ("completed", 2, 1)
    assert tries == {"0": 1, "1": 3, "2": 1}
    assert output_of(job) == [{"text": "0"}, {"text": "1"}, error]


def stopped_mid_line(
    store: JobStore, job: Job, reason: str, answered: frozenset[str] = frozenset()
) -> asyncio.Task[None]:
    """Run the job until a line it does not answer (prompts not in `answered`) is in flight,
    then stop it for `reason`; its task, once done."""

    async def main() -> asyncio.Task[None]:
        waiting, release = asyncio.Event(), asyncio.Event()

        async def caller(kind: str, body: dict[str, Any], owner: Owner) -> dict[str, Any]:
            if body["prompt"] in answered:
                return answer(body)
            waiting.set()
            return await never(release)

        runner = Runner(store, caller, window=2)
        runner.start(job)
        task = runner.tasks[job.job_id]
        await asyncio.wait_for(waiting.wait(), WAIT_SECONDS)
        if reason == "cancelled":  # as the API asks it
            store.ask_to_stop(job.job_id, CANCEL_MARKER)
        assert runner.stop(job.job_id, reason) is task
        await asyncio.wait({task}, timeout=WAIT_SECONDS)
        return task

    return asyncio.run(main())


def test_a_cancelled_job_marks_the_lines_it_did_not_run_499(tmp_path: Path) -> None:
    store, job = stored_job(tmp_path, 4)
    task = stopped_mid_line(store, job, "cancelled", frozenset({"0"}))
    assert task.done() and not task.cancelled()
    ended = store.load(job.job_id)
    assert ended is not None
    assert (ended.status, ended.completed, ended.failed) == ("cancelled", 1, 0)
    items = output_of(job)
    assert items[0] == {"text": "0"}
    assert [item["error"]["status_code"] for item in items[1:]] == [499, 499, 499]


def test_a_job_past_its_max_runtime_fails_with_its_lines_not_run_504(tmp_path: Path) -> None:
    store, job = stored_job(tmp_path, 3, expires_at=time.time() - 1)

    async def main() -> None:
        release = asyncio.Event()

        async def caller(kind: str, body: dict[str, Any], owner: Owner) -> dict[str, Any]:
            return await never(release)

        await run_to_end(Runner(store, caller, window=2), job)

    asyncio.run(main())
    ended = store.load(job.job_id)
    assert ended is not None
    assert ended.status == "failed"
    assert ended.error is not None and "max_runtime_sec" in ended.error
    assert [item["error"]["status_code"] for item in output_of(job)] == [504, 504, 504]


def test_a_resumed_job_runs_only_the_lines_its_record_lacks(tmp_path: Path) -> None:
    store, job = stored_job(tmp_path, 4, status="running")
    earlier = {0: answer({"prompt": "0"}), 2: {"error": {"status_code": 400, "detail": "x"}}}
    with store.open_record(job.job_id, 0) as record:
        for index, result in earlier.items():
            record_line(record, index, result)
    called: list[str] = []

    async def caller(kind: str, body: dict[str, Any], owner: Owner) -> dict[str, Any]:
        called.append(body["prompt"])
        return answer(body)

    asyncio.run(run_to_end(Runner(store, caller, window=2), job))
    assert sorted(called) == ["1", "3"]
    ended = store.load(job.job_id)
    assert ended is not None
    assert (ended.status, ended.completed, ended.failed) == ("completed", 3, 1)
    assert output_of(job) == [
        {"text": "0"},
        {"text": "1"},
        {"error": {"status_code": 400, "detail": "x"}},
        {"text": "3"},
    ]


def test_a_job_asked_to_cancel_while_nobody_ran_it_ends_without_a_call(tmp_path: Path) -> None:
    store, job = stored_job(tmp_path, 2)
    (store.directory(job.job_id) / CANCEL_MARKER).touch()
    called: list[str] = []

    async def caller(kind: str, body: dict[str, Any], owner: Owner) -> dict[str, Any]:
        called.append(body["prompt"])
        return answer(body)

    asyncio.run(run_to_end(Runner(store, caller, window=2), job))
    assert called == []
    ended = store.load(job.job_id)
    assert ended is not None and ended.status == "cancelled"
    assert [item["error"]["status_code"] for item in output_of(job)] == [499, 499]


def test_a_shutdown_leaves_the_job_unfinished_and_its_output_unwritten(tmp_path: Path) -> None:
    store, job = stored_job(tmp_path, 3)
    assert stopped_mid_line(store, job, "shutdown").cancelled()
    ended = store.load(job.job_id)
    assert ended is not None and ended.status == "running"
    assert not ended.terminal
    assert not Path(job.output_file).exists()
    assert store.results(job) == {}


# jobs


def batch_jobs(root: Path, caller: Caller | None = None) -> BatchJobs:
    async def answering(kind: str, body: dict[str, Any], owner: Owner) -> dict[str, Any]:
        await asyncio.sleep(0.01)
        return answer(body)

    runner = Runner(JobStore(root), caller or answering, window=2)
    return BatchJobs(BatchSettings(root=root), runner, ENGINE, accept_all)


@pytest.mark.parametrize("job_id", ["batch-a", "batch-unknown", "../batch-a", ""])
def test_a_job_is_not_found_by_anyone_but_its_owner_nor_by_a_bad_id(
    tmp_path: Path, job_id: str
) -> None:
    jobs = batch_jobs(tmp_path)
    jobs.store.create(make_job(tmp_path, 1), [{"prompt": "a"}])
    assert jobs.owned("batch-a", OWNER).job_id == "batch-a"
    for owner in (OWNER, STRANGER) if job_id != "batch-a" else (STRANGER,):
        with pytest.raises(JobNotFoundError) as missing:
            jobs.owned(job_id, owner)
        assert missing.value.grpc_code == grpc.StatusCode.NOT_FOUND


def test_a_list_holds_only_the_owners_jobs_newest_first(tmp_path: Path) -> None:
    jobs = batch_jobs(tmp_path)
    for job_id, created, owner in (
        ("batch-old", 100.0, OWNER),
        ("batch-new", 300.0, OWNER),
        ("batch-theirs", 200.0, STRANGER),
        ("batch-mid", 200.0, OWNER),
    ):
        job = make_job(tmp_path, 1, job_id=job_id, created_at=created, owner=owner.principal)
        jobs.store.create(job, [{"prompt": "a"}])
    assert [job.job_id for job in jobs.list(OWNER)] == ["batch-new", "batch-mid", "batch-old"]
    assert [job.job_id for job in jobs.list(STRANGER)] == ["batch-theirs"]


def test_an_update_changes_the_priority(tmp_path: Path) -> None:
    jobs = batch_jobs(tmp_path)
    jobs.store.create(make_job(tmp_path, 1), [{"prompt": "a"}])
    job, changed = asyncio.run(jobs.update("batch-a", "high", OWNER))
    assert changed and job.priority == "high"
    assert jobs.owned("batch-a", OWNER).priority == "high"
    assert asyncio.run(jobs.update("batch-a", None, OWNER))[1] is False
    with pytest.raises(JobNotFoundError):
        asyncio.run(jobs.update("batch-a", "low", STRANGER))


def test_cancelling_a_job_nobody_runs_ends_it_and_writes_its_output(tmp_path: Path) -> None:
    jobs = batch_jobs(tmp_path)
    job = make_job(tmp_path, 2)
    jobs.store.create(job, [{"prompt": "a"}, {"prompt": "b"}])
    with jobs.store.open_record(job.job_id, 0) as record:
        record_line(record, 0, answer({"prompt": "a"}))

    async def main() -> tuple[bool, bool]:
        return await jobs.cancel(job.job_id, OWNER), await jobs.cancel(job.job_id, OWNER)

    assert asyncio.run(main()) == (True, False)
    ended = jobs.owned(job.job_id, OWNER)
    assert ended.status == "cancelled" and ended.completed_at is not None
    assert output_of(job) == [{"text": "a"}, output_of(job)[1]]
    assert output_of(job)[1]["error"]["status_code"] == 499


def test_a_job_created_from_content_is_watched_until_it_ends(tmp_path: Path) -> None:
    jobs = batch_jobs(tmp_path)
    request = json_format.ParseDict(llm_engine_body(), CreateBatchCompletionRequest())
    request.content.list_value.values.add().struct_value.update(
        {"messages": [{"role": "user", "content": "b"}]}
    )

    async def main() -> tuple[Job, list[Job]]:
        job = await jobs.create(request, OWNER)
        seen = []

        async def watch() -> None:
            async for update in jobs.watch(job.job_id, OWNER):
                seen.append(update)

        await asyncio.wait_for(watch(), WAIT_SECONDS)
        return job, seen

    job, seen = asyncio.run(main())
    assert job.kinds == ["completion", "chat"]
    assert job.output_file == str(tmp_path.resolve() / "out.json")
    assert jobs.store.lines(job.job_id)[1]["model"] == "m"
    assert seen[0].status in ("queued", "running")
    assert [update.terminal for update in seen] == [False] * (len(seen) - 1) + [True]
    assert (seen[-1].status, seen[-1].completed) == ("completed", 2)


def test_creating_a_job_refuses_every_bad_field_together(tmp_path: Path) -> None:
    body = llm_engine_body()
    body.update(output_data_path="../out.json", gpus=1)
    request = json_format.ParseDict(body, CreateBatchCompletionRequest())
    with pytest.raises(RequestValidationError) as refused:
        asyncio.run(batch_jobs(tmp_path).create(request, OWNER))
    assert sorted(v.loc for v in refused.value.violations) == [("gpus",), ("output_data_path",)]
    assert not any(JobStore(tmp_path).jobs.iterdir())


# batch_lines


def test_a_line_call_runs_as_its_owner_only_with_this_processes_token() -> None:
    owner = Owner("tenant-a", "a", "k1")
    said = (LINE_OWNER_HEADER, json.dumps(asdict(owner)))
    assert line_owner(((LINE_TOKEN_HEADER, LINE_TOKEN), said)) == owner
    assert line_owner(((LINE_TOKEN_HEADER, LINE_TOKEN + "x"), said)) is None
    assert line_owner(((LINE_TOKEN_HEADER, LINE_TOKEN.encode()), said)) is None
    assert line_owner((said,)) is None


def rpc_error(code: grpc.StatusCode, *trailers: tuple[str, str]) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailers), "the details"
    )


def test_a_refused_line_answers_the_rest_status_and_body() -> None:
    body = json.dumps({"detail": "prompt is too long"})
    refused = rpc_error(
        grpc.StatusCode.INVALID_ARGUMENT, ("x-http-status", "400"), ("x-error-body", body)
    )
    assert asyncio.run(refusal(refused)) == {
        "error": {"status_code": 400, "detail": "prompt is too long"}
    }
    error = RequestValidationError([FieldViolation(("temperature",), "too hot", "value_error")])
    invalid = rpc_error(grpc.StatusCode.INVALID_ARGUMENT, *error_metadata(error))
    assert asyncio.run(refusal(invalid)) == {
        "error": {
            "status_code": 422,
            "detail": [{"loc": ["body", "temperature"], "msg": "too hot", "type": "value_error"}],
        }
    }
    bare = asyncio.run(refusal(rpc_error(grpc.StatusCode.INTERNAL)))
    assert bare == {"error": {"status_code": 500, "detail": "the details"}}


@pytest.mark.parametrize(
    ("code", "trailers", "seconds"),
    [
        (grpc.StatusCode.RESOURCE_EXHAUSTED, (("x-http-status", "429"), ("retry-after", "7")), 7),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, (("x-http-status", "429"),), 1),
        (grpc.StatusCode.UNAVAILABLE, (), 1),
        (grpc.StatusCode.UNAVAILABLE, (("x-http-status", "503"), ("retry-after", "2")), 2),
    ],
)
def test_a_held_back_line_is_retried_after_the_servers_retry_after(
    code: grpc.StatusCode, trailers: tuple[tuple[str, str], ...], seconds: float
) -> None:
    with pytest.raises(RetryLaterError) as held:
        asyncio.run(refusal(rpc_error(code, *trailers)))
    assert held.value.seconds == seconds


# auth


def basic(credentials: bytes) -> str:
    return "Basic " + base64.b64encode(credentials).decode()


@pytest.mark.parametrize(
    ("metadata", "key"),
    [
        ((("authorization", "Bearer k"),), "k"),
        ((("authorization", "bearer  k "),), "k"),
        ((("authorization", basic(b"k:")),), "k"),
        ((("authorization", basic(b"k")),), "k"),
        ((("x-api-key", "k"),), "k"),
        ((("user-agent", "x"), ("x-api-key", " k ")), "k"),
        ((("authorization", "Basic %%%not-base64"),), None),
        ((("authorization", basic(b":secret")),), None),
        ((("authorization", basic(b"\xff\xfe:")),), None),
        ((("x-api-key", " "),), None),
        ((), None),
    ],
)
def test_a_key_is_taken_as_bearer_as_llm_engines_basic_user_or_as_x_api_key(
    metadata: tuple[tuple[str, str], ...], key: str | None
) -> None:
    assert presented_key(metadata) == key


def test_basic_credentials_give_their_user_name() -> None:
    assert basic_user(base64.b64encode(b"key-1:").decode()) == "key-1"
    assert basic_user("not base64!") is None
    assert basic_user(base64.b64encode(b"").decode()) is None


# what broke once


@pytest.mark.parametrize("given", [".batch-jobs/evil/job.json", ".batch-jobs", ".", "sub"])
def test_the_jobs_records_and_directories_are_no_callers_file(tmp_path: Path, given: str) -> None:
    (tmp_path / "sub").mkdir()
    JobStore(tmp_path)  # makes .batch-jobs
    found = Violations()
    assert confined(tmp_path, (), given, "output_data_path", found) is None
    assert found.items and found.items[0].loc == ("output_data_path",)


def test_a_job_file_that_is_not_a_job_is_no_job(tmp_path: Path) -> None:
    store, job = stored_job(tmp_path, 1)
    (store.directory(job.job_id) / "job.json").write_text("[1, 2]")
    assert store.load(job.job_id) is None and store.all() == []


def test_an_input_file_that_is_no_utf8_text_is_refused(tmp_path: Path) -> None:
    (tmp_path / "in.bin").write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(RequestValidationError) as refused:
        read_input_file(str(tmp_path / "in.bin"), BatchSettings(root=tmp_path), "input_data_path")
    assert refused.value.violations[0].loc == ("input_data_path",)


def test_a_line_whose_call_raises_fails_alone(tmp_path: Path) -> None:
    store, job = stored_job(tmp_path, 5)

    async def caller(kind: str, body: dict[str, Any], owner: Owner) -> dict[str, Any]:
        if body["prompt"] == "1":
            raise ValueError("a fault of the server's")
        return answer(body)

    asyncio.run(run_to_end(Runner(store, caller, window=2), job))
    ended = store.load(job.job_id)
    assert ended is not None and (ended.status, ended.completed, ended.failed) == (
        "completed",
        4,
        1,
    )
    assert output_of(job)[1]["error"]["status_code"] == 500


def test_a_job_cancelled_before_its_task_ran_reads_cancelled_at_once(tmp_path: Path) -> None:
    jobs = batch_jobs(tmp_path)
    job = make_job(tmp_path, 2)
    jobs.store.create(job, [{"prompt": "a"}, {"prompt": "b"}])

    async def main() -> bool:
        jobs.runner.start(job)
        return await jobs.cancel(job.job_id, OWNER)

    assert asyncio.run(main()) is True
    assert jobs.owned(job.job_id, OWNER).status == "cancelled"
    assert jobs.runner.stops == {}


class CountedEnds:
    def __init__(self) -> None:
        self.ended: list[str] = []

    def line_finished(self, result: str) -> None:
        pass

    def job_ended(self, status: str) -> None:
        self.ended.append(status)


def test_a_jobs_shards_spread_over_processes_and_the_last_one_out_ends_it(
    tmp_path: Path,
) -> None:
    """Two runners on one store (as two replicas on a shared root): each takes a shard of the
    job's two, every line runs once, and the job ends once, with its output whole."""
    store, job = stored_job(tmp_path, 12, shards=2)
    ran: dict[int, list[int]] = {0: [], 1: []}
    ends = CountedEnds()

    def caller_of(name: int) -> Caller:
        async def caller(kind: str, body: dict[str, Any], owner: Owner) -> dict[str, Any]:
            ran[name].append(int(body["prompt"]))
            await asyncio.sleep(0.01 * (1 + name))
            return answer(body)

        return caller

    async def main() -> None:
        runners = [Runner(JobStore(tmp_path), caller_of(n), window=2, counts=ends) for n in (0, 1)]
        for runner in runners:
            runner.start(job)
        tasks = [asyncio.shield(runner.tasks[job.job_id]) for runner in runners]
        await asyncio.wait_for(asyncio.gather(*tasks), WAIT_SECONDS)

    asyncio.run(main())
    assert sorted(ran[0]) == list(range(0, 12, 2)) and sorted(ran[1]) == list(range(1, 12, 2))
    assert ends.ended == ["completed"]
    ended = store.load(job.job_id)
    assert ended is not None and (ended.status, ended.completed) == ("completed", 12)
    assert output_of(job) == [{"text": str(index)} for index in range(12)]


def test_a_lone_process_runs_every_shard_and_a_failing_shard_fails_the_job(
    tmp_path: Path,
) -> None:
    store, job = stored_job(tmp_path, 6, shards=3)
    order: list[int] = []

    async def caller(kind: str, body: dict[str, Any], owner: Owner) -> dict[str, Any]:
        order.append(int(body["prompt"]))
        return answer(body)

    asyncio.run(run_to_end(Runner(store, caller, window=1), job))
    assert order == [0, 3, 1, 4, 2, 5]  # shard after shard
    assert output_of(job) == [{"text": str(index)} for index in range(6)]

    failing, failing_job = stored_job(tmp_path / "failing", 6, shards=2)

    async def fail(*args: Any) -> None:
        raise RuntimeError("the record's disk is full")

    runner = Runner(failing, caller, window=1)
    runner.run_lines = fail  # type: ignore[method-assign]

    asyncio.run(run_to_end(runner, failing_job))
    ended = failing.load(failing_job.job_id)
    assert ended is not None and ended.status == "failed"
    assert ended.error == "RuntimeError: the record's disk is full"
    assert [item["error"]["status_code"] for item in output_of(failing_job)] == [500] * 6


def test_a_shard_is_free_work_unless_held_or_done(tmp_path: Path) -> None:
    jobs = batch_jobs(tmp_path)
    job = make_job(tmp_path, 4, shards=2)
    jobs.store.create(job, [{"prompt": str(index)} for index in range(4)])
    assert jobs.has_free_work(job)  # nobody runs it
    with jobs.store.held(job.job_id, 0):
        assert jobs.has_free_work(job)  # shard 1 waits
        jobs.store.save_progress(job.job_id, 1, completed=1, failed=1)
        assert not jobs.has_free_work(job)  # shard 1 is done; shard 0 runs
    assert jobs.has_free_work(job)  # nobody runs shard 0 any more


def test_a_result_after_a_torn_line_starts_a_line_of_its_own(tmp_path: Path) -> None:
    store, job = stored_job(tmp_path, 3)
    with store.open_record(job.job_id, 0) as record:
        record_line(record, 0, answer({"prompt": "0"}))
        record.write('{"index": 1, "res')  # the crash
    with store.open_record(job.job_id, 0) as record:
        record_line(record, 2, answer({"prompt": "2"}))
    assert set(store.results(job)) == {0, 2}


def test_lines_yield_to_interactive_calls_down_to_a_32nd_of_the_window(
    tmp_path: Path,
) -> None:
    """While interactive calls run, no new line starts until the lines in flight are down to a
    32nd of the window; alone, the whole window runs."""
    peaks: dict[str, int] = {}

    def peak(interactive: int) -> int:
        store, job = stored_job(tmp_path / str(interactive), 80)
        flying = 0
        highest = 0

        async def caller(kind: str, body: dict[str, Any], owner: Owner) -> dict[str, Any]:
            nonlocal flying, highest
            flying += 1
            highest = max(highest, flying)
            try:
                await asyncio.sleep(0.02)
            finally:
                flying -= 1
            return answer(body)

        runner = Runner(store, caller, window=64, interactive_calls=lambda: interactive)
        asyncio.run(run_to_end(runner, job))
        return highest

    peaks = {"alone": peak(0), "beside calls": peak(1)}
    assert peaks == {"alone": 64, "beside calls": 2}


def test_an_interactive_call_stops_the_newest_lines_which_run_again_later(
    tmp_path: Path,
) -> None:
    """A call comes while a whole window of lines runs: all but the oldest 32nd are stopped at
    once, and run again once it has gone; every line is recorded once."""
    store, job = stored_job(tmp_path, 64)
    calls = 0
    started: list[int] = []
    stopped: list[int] = []
    in_flight_after_the_call: list[int] = []
    flying = 0

    async def caller(kind: str, body: dict[str, Any], owner: Owner) -> dict[str, Any]:
        nonlocal flying
        index = int(body["prompt"])
        started.append(index)
        flying += 1
        try:
            await asyncio.sleep(0.3 if len(started) <= 64 else 0.01)
        except asyncio.CancelledError:
            stopped.append(index)
            raise
        finally:
            flying -= 1
        return answer(body)

    async def main() -> None:
        nonlocal calls
        runner = Runner(store, caller, window=64, interactive_calls=lambda: calls)
        runner.start(job)
        await asyncio.sleep(0.1)  # the whole window in flight
        calls = 1
        await asyncio.sleep(0.1)
        in_flight_after_the_call.append(flying)
        calls = 0
        await asyncio.wait_for(asyncio.shield(runner.tasks[job.job_id]), WAIT_SECONDS)

    asyncio.run(main())
    assert in_flight_after_the_call == [2]
    assert sorted(stopped) == list(range(2, 64)), "the newest 62 stopped"
    assert sorted(started) == sorted([*range(64), *range(2, 64)])
    assert store.results(job) == {i: answer({"prompt": str(i)}) for i in range(64)}
    assert output_of(job) == [{"text": str(index)} for index in range(64)]
