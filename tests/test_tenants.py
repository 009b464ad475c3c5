"""Tenants on the default stack (its tenants file beside API_KEY): keys that name a tenant,
models outside its patterns answered as unknown, listing filtered, requests and tokens per
minute (429 with retry-after, OpenAI's rate-limit headers, tokens charged however a call
ends), the file reloaded live (a bad one keeps the last table), and the metrics naming the
tenant; REST through Envoy and direct gRPC alike."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from google.protobuf import json_format
from llmcompletions.v2 import completions_pb2_grpc
from llmcompletions.v2.completions_pb2 import (
    CancelCompletionRequest,
    CreateChatCompletionRequest,
    ListModelsRequest,
)

from service.api.rate_limits import TenantLimits
from service.api.tenants import Caller, Limits
from tests.conftest import MODEL, TENANT_KEYS, tenants_yaml
from tests.helpers import grpc_request
from tests.metrics import sample, scrape
from tests.processes import TestStack
from tests.redis_server import RedisServer

RELOAD_SECONDS = 5  # the file is checked every second; a change takes effect within this


def bearer(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TENANT_KEYS[tenant]}"}


def grpc_auth(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


@pytest.fixture(scope="module")
def stub(stack: TestStack) -> Iterator[completions_pb2_grpc.CompletionServiceStub]:
    with grpc.insecure_channel(stack.grpc_target) as channel:
        yield completions_pb2_grpc.CompletionServiceStub(channel)


def tenants_file(stack: TestStack) -> Path:
    return Path(stack.service_args[stack.service_args.index("--tenants-file") + 1])


def rest_completion(
    stack: TestStack, key: str, model: str = MODEL, **fields: object
) -> httpx.Response:
    payload = {"model": model, "prompt": "Hi", "max_tokens": 2, **fields}
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{stack.base_url}/v2/completions", json=payload, headers=headers, timeout=60)


def grpc_code(call: object) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as error:
        list(call)  # type: ignore[call-overload]
    return error.value.code()


def test_an_unknown_key_is_refused_on_both_surfaces(
    stack: TestStack, stub: completions_pb2_grpc.CompletionServiceStub
) -> None:
    assert rest_completion(stack, "not-a-tenants-key").status_code == 401
    call = stub.CreateCompletion(
        grpc_request(prompt="Hi", max_tokens=2), timeout=30, metadata=grpc_auth("nope")
    )
    assert grpc_code(call) == grpc.StatusCode.UNAUTHENTICATED
    assert rest_completion(stack, TENANT_KEYS["team-a"]).status_code == 200


def test_a_model_outside_the_tenants_patterns_is_unknown_and_unlisted(
    stack: TestStack, stub: completions_pb2_grpc.CompletionServiceStub
) -> None:
    """team-b may reach only someone-elses-*: the served model answers as a name that does not
    exist does, and its listing is empty; team-a's lists the model."""
    scoped = rest_completion(stack, TENANT_KEYS["team-b"])
    unknown = rest_completion(stack, TENANT_KEYS["team-a"], model="no-such-model")
    assert scoped.status_code == unknown.status_code == 404
    # The same answer as for a name nobody serves, naming none of what the tenant cannot use.
    assert MODEL not in scoped.json()["detail"].split("served models are")[1]
    assert "served models are" in unknown.json()["detail"]
    call = stub.CreateCompletion(
        grpc_request(prompt="Hi", max_tokens=2),
        timeout=30,
        metadata=grpc_auth(TENANT_KEYS["team-b"]),
    )
    assert grpc_code(call) == grpc.StatusCode.NOT_FOUND
    listings = {
        tenant: stub.ListModels(ListModelsRequest(), metadata=grpc_auth(TENANT_KEYS[tenant]))
        for tenant in ("team-a", "team-b")
    }
    assert [model.id for model in listings["team-a"].data] == [MODEL]
    assert list(listings["team-b"].data) == []
    rest = httpx.get(f"{stack.base_url}/v2/models", headers=bearer("team-b"), timeout=30)
    assert rest.status_code == 200 and rest.json()["data"] == []


def test_a_tenant_past_its_rpm_gets_429_with_retry_after_while_another_is_served(
    stack: TestStack, stub: completions_pb2_grpc.CompletionServiceStub
) -> None:
    served = [rest_completion(stack, TENANT_KEYS["burst"]) for _ in range(2)]
    assert [reply.status_code for reply in served] == [200, 200]
    assert served[0].headers["x-ratelimit-limit-requests"] == "2"
    assert served[1].headers["x-ratelimit-remaining-requests"] == "0"
    refused = rest_completion(stack, TENANT_KEYS["burst"])
    assert refused.status_code == 429
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    assert "rpm" in refused.text and "burst" in refused.text
    call = stub.CreateCompletion(
        grpc_request(prompt="Hi", max_tokens=2),
        timeout=30,
        metadata=grpc_auth(TENANT_KEYS["burst"]),
    )
    assert grpc_code(call) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert rest_completion(stack, TENANT_KEYS["team-a"]).status_code == 200
    limited = sample(
        stack.metrics_url, "llmcompletions_rate_limited_total", tenant="burst", limit="rpm"
    )
    assert limited >= 2


def probe(stack: TestStack) -> tuple[int, int]:
    """What `metered` had left when a small call of its was counted (its header), and that
    call's own tokens."""
    reply = rest_completion(stack, TENANT_KEYS["metered"], max_tokens=1)
    assert reply.status_code == 200, reply.text
    time.sleep(0.2)  # its charge is made as it ends
    return int(reply.headers["x-ratelimit-remaining-tokens"]), reply.json()["usage"]["total_tokens"]


def charged_between(first: tuple[int, int], second: tuple[int, int]) -> int:
    """The tokens charged between two probes, besides the first probe's own."""
    (remaining, own), (later, _) = first, second
    return remaining - own - later


def test_tpm_charges_prompt_and_completion_tokens_whole_streamed_and_cancelled(
    stack: TestStack, stub: completions_pb2_grpc.CompletionServiceStub
) -> None:
    start = probe(stack)
    whole = rest_completion(stack, TENANT_KEYS["metered"], max_tokens=6, n=2, ignore_eos=True)
    assert whole.json()["usage"]["completion_tokens"] == 12  # every choice's tokens
    after_whole = probe(stack)
    assert charged_between(start, after_whole) == whole.json()["usage"]["total_tokens"]
    streamed = stub.CreateCompletion(
        grpc_request(
            prompt="Hi",
            max_tokens=5,
            stream=True,
            ignore_eos=True,
            stream_options={"include_usage": True},
        ),
        timeout=30,
        metadata=grpc_auth(TENANT_KEYS["metered"]),
    )
    usage = [message.usage for message in streamed if message.HasField("usage")][-1]
    after_stream = probe(stack)
    assert charged_between(after_whole, after_stream) == usage.total_tokens
    cancelled = stub.CreateCompletion(
        grpc_request(prompt="Count:", max_tokens=400, stream=True, ignore_eos=True),
        timeout=60,
        metadata=grpc_auth(TENANT_KEYS["metered"]),
    )
    received = sum(1 for _, _ in zip(range(3), cancelled, strict=False))
    while_streaming = probe(stack)
    # Its prompt is charged once tokenized, while it streams: a few tokens ("Count:").
    assert 0 < charged_between(after_stream, while_streaming) < 10
    cancelled.cancel()
    time.sleep(0.5)
    generated = charged_between(while_streaming, probe(stack))
    assert received == 3
    assert 3 <= generated < 400, f"a cancelled stream is charged what it generated: {generated}"
    # A chat's prompt too: vLLM's chat serving tells its count as soon as it is rendered.
    before_chat = probe(stack)
    chat = stub.CreateChatCompletion(
        json_format.ParseDict(
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "Count:"}],
                "max_tokens": 400,
                "stream": True,
                "ignore_eos": True,
            },
            CreateChatCompletionRequest(),
        ),
        timeout=60,
        metadata=grpc_auth(TENANT_KEYS["metered"]),
    )
    assert sum(1 for _, _ in zip(range(3), chat, strict=False)) == 3
    prompt = charged_between(before_chat, probe(stack))
    chat.cancel()
    assert 5 < prompt < 100, f"a streaming chat's templated prompt is charged at once: {prompt}"


def test_a_key_added_or_removed_in_the_file_takes_effect_within_seconds(
    stack: TestStack,
) -> None:
    path = tenants_file(stack)
    new_key = "team-a-rotated-key-7777"
    try:
        path.write_text(tenants_yaml({"team-a-2": new_key}))
        assert until_status(stack, new_key, 200) <= RELOAD_SECONDS
        assert_cancels_reach_the_tenants_requests_whichever_key(stack, new_key)
        path.write_text(tenants_yaml())
        assert until_status(stack, new_key, 401) <= RELOAD_SECONDS
        reloads = "llmcompletions_tenants_reloads_total"
        invalid = sample(stack.metrics_url, reloads, result="invalid") or 0
        path.write_text("version: 1\ntenants: {team-a: {keys: []}}\n")
        deadline = time.monotonic() + RELOAD_SECONDS
        while (sample(stack.metrics_url, reloads, result="invalid") or 0) == invalid:
            assert time.monotonic() < deadline, "the bad file was never noticed"
            time.sleep(0.2)
        assert rest_completion(stack, TENANT_KEYS["team-a"]).status_code == 200  # old table
    finally:
        path.write_text(tenants_yaml())
        until_status(stack, TENANT_KEYS["team-b"], 404)  # the file's table again


def until_status(stack: TestStack, key: str, status: int) -> float:
    started = time.monotonic()
    while rest_completion(stack, key).status_code != status:
        assert time.monotonic() - started < RELOAD_SECONDS + 5, f"never {status}"
        time.sleep(0.2)
    return time.monotonic() - started


def test_a_tenants_budget_is_shared_with_every_replica_of_the_store(
    stack: TestStack, limits_redis: RedisServer
) -> None:
    """Another replica's limits on the same Redis (as a fleet's replicas share it) spend two of
    the tenant's three requests; this replica refuses the tenant's next call, then the store goes
    down: calls pass, and the store's errors are counted."""
    other_replica = TenantLimits(limits_redis.url)
    caller = Caller("shared", "k", None, Limits(rpm=3))

    async def spend(times: int) -> None:
        for _ in range(times):
            await other_replica.admit(caller)

    asyncio.run(spend(2))
    served = rest_completion(stack, TENANT_KEYS["shared"])
    assert served.status_code == 200 and served.headers["x-ratelimit-remaining-requests"] == "0"
    assert rest_completion(stack, TENANT_KEYS["shared"]).status_code == 429
    errors = "llmcompletions_limits_store_errors_total"
    before = sum(v for (name, _), v in scrape(stack.metrics_url).items() if name == errors)
    limits_redis.stop()
    assert rest_completion(stack, TENANT_KEYS["shared"]).status_code == 200  # fails open
    after = sum(v for (name, _), v in scrape(stack.metrics_url).items() if name == errors)
    assert after > before


def test_the_metrics_and_the_log_name_the_tenant_never_the_key(stack: TestStack) -> None:
    def counts() -> tuple[float, float, float]:
        ok = {"method": "CreateCompletion", "code": "OK", "tenant": "team-a"}
        return (
            sample(stack.metrics_url, "llmcompletions_requests_total", **ok),
            sample(stack.metrics_url, "llmcompletions_completion_tokens_total", tenant="team-a"),
            sample(stack.metrics_url, "llmcompletions_auth_failures_total", reason="unknown"),
        )

    before = counts()
    reply = rest_completion(
        stack, TENANT_KEYS["team-a"], max_tokens=3, ignore_eos=True, user="metered-call"
    )
    assert reply.status_code == 200
    assert rest_completion(stack, "no-such-key").status_code == 401
    after = counts()
    assert after[0] - before[0] == 1 and after[1] - before[1] == 3 and after[2] - before[2] == 1
    assert stack.service_log is not None
    (line,) = [
        line
        for line in stack.service_log.read_text().splitlines()
        if reply.headers["x-request-id"] in line and " request " in f" {line} "
    ]
    assert "tenant='team-a'" in line and "key_id='team-a-1'" in line
    assert all(key not in stack.service_log.read_text() for key in TENANT_KEYS.values())


def assert_cancels_reach_the_tenants_requests_whichever_key(
    stack: TestStack, other_key: str
) -> None:
    """A stream sent with one of team-a's keys: another tenant's cancel is refused, and
    team-a's other key cancels it."""
    request_id = f"tenant-cancel-{time.monotonic_ns()}"
    with grpc.insecure_channel(stack.grpc_target) as channel:
        stub = completions_pb2_grpc.CompletionServiceStub(channel)
        call = stub.CreateCompletion(
            grpc_request(prompt="Count:", max_tokens=400, stream=True, ignore_eos=True),
            timeout=60,
            metadata=(*grpc_auth(TENANT_KEYS["team-a"]), ("x-request-id", request_id)),
        )
        next(call)
        with pytest.raises(grpc.RpcError) as refused:
            stub.CancelCompletion(
                CancelCompletionRequest(request_id=request_id),
                timeout=30,
                metadata=grpc_auth(TENANT_KEYS["team-b"]),
            )
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        done = stub.CancelCompletion(
            CancelCompletionRequest(request_id=request_id),
            timeout=30,
            metadata=grpc_auth(other_key),
        )
        assert done.cancelled == 1
        assert grpc_code(call) == grpc.StatusCode.CANCELLED
