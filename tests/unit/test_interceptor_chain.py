"""The interceptor chain on hand-made calls: every call is recorded once with its true
status, errors become statuses (or an in-band message once output began), REST calls get
their framing and end sentinel, a refusal at capacity carries its retry hint, and every call
ends with the replica's load report."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from google.protobuf import struct_pb2
from llmcompletions.v2.completions_pb2 import (
    CancelCompletionRequest,
    CancelCompletionResponse,
    Choice,
    CreateCompletionRequest,
    CreateCompletionResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from xds.data.orca.v3.orca_load_report_pb2 import OrcaLoadReport

from service.api.errors import ModelNotFoundError, OverloadedError
from service.model.load import LoadSnapshot
from service.transport.error_mapping import ErrorMappingInterceptor
from service.transport.load_reports import LoadReports
from service.transport.observability import CALLER_TEXT_CHARS, REQUESTS, read_while_served
from service.transport.request_context import RequestContextInterceptor, current_record
from service.transport.rest_bridge import END_OF_EVENTS, FRAMING_HEADER, HTTP_STATUS_HEADER

METHOD = "CreateCompletion"
METHODS = frozenset({f"/x/{METHOD}"})
CHUNK = CreateCompletionResponse(choices=[Choice(text="hi")])
# 3 running and 5 waiting of a batch of 4, a quarter of the KV cache in use.
LOAD = LoadSnapshot(
    running=3,
    waiting=5,
    kv_cache_usage=0.25,
    max_num_seqs=4,
    max_num_queued_reqs=32,
    adapters=("sql",),
)


class FakeContext:
    """What the interceptors use of grpc.aio.ServicerContext."""

    def __init__(self, metadata: tuple[tuple[str, str], ...] = (), remaining: float = 60) -> None:
        self.metadata = metadata
        self.remaining = remaining
        self.initial: tuple[tuple[str, str], ...] | None = None
        self.status: grpc.StatusCode | None = None
        self.trailing: dict[str, Any] = {}

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata

    async def send_initial_metadata(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.initial = metadata

    async def abort(self, code: grpc.StatusCode, details: str, trailing_metadata: Any = ()) -> None:
        self.status = code
        self.trailing = dict(trailing_metadata)
        raise grpc.aio.AbortError()

    def set_trailing_metadata(self, metadata: tuple[tuple[str, Any], ...]) -> None:
        self.trailing = dict(metadata)

    def code(self) -> grpc.StatusCode | None:
        return self.status

    def time_remaining(self) -> float:
        return self.remaining


def chain(servicer: Any) -> Any:
    """The behaviour the server would run: interceptors around the servicer, outermost first."""
    behaviour = ErrorMappingInterceptor(METHODS, 1 << 20, LoadReports(lambda: LOAD)).around
    inner = servicer

    def wrap(around: Any, inner: Any) -> Any:
        return lambda request, context: around(inner, METHOD, request, context)

    inner = wrap(behaviour, inner)
    return wrap(RequestContextInterceptor(METHODS).around, inner)


def counted(code: str) -> float:
    return REQUESTS.labels(METHOD, code, "")._value.get()


async def drain(behaviour: Any, request: Any, context: FakeContext) -> list[Any]:
    messages = []
    try:
        async for message in behaviour(request, context):
            messages.append(message)
    except grpc.aio.AbortError:
        pass
    return messages


async def two_chunks(request: Any, context: Any) -> AsyncIterator[CreateCompletionResponse]:
    yield CHUNK
    yield CHUNK


async def fails_after_one(request: Any, context: Any) -> AsyncIterator[CreateCompletionResponse]:
    yield CHUNK
    raise ModelNotFoundError("a", ["b"])


async def fails_at_once(request: Any, context: Any) -> AsyncIterator[CreateCompletionResponse]:
    raise ModelNotFoundError("a", ["b"])
    yield CHUNK


def test_a_rest_stream_gets_its_framing_then_ends_with_the_sentinel() -> None:
    context = FakeContext((("x-envoy-original-path", "/v2/completions"),))
    before = counted("OK")
    messages = asyncio.run(drain(chain(two_chunks), CreateCompletionRequest(stream=True), context))
    assert messages == [CHUNK, CHUNK, END_OF_EVENTS]
    assert context.initial is not None and (FRAMING_HEADER, "sse") in context.initial
    assert counted("OK") == before + 1


def test_an_error_before_output_is_a_status_with_the_rest_form() -> None:
    context = FakeContext((("x-envoy-original-path", "/v2/completions"),))
    before = counted("NOT_FOUND")
    assert asyncio.run(drain(chain(fails_at_once), CreateCompletionRequest(), context)) == []
    assert context.status == grpc.StatusCode.NOT_FOUND
    assert context.trailing[HTTP_STATUS_HEADER] == "404"
    assert counted("NOT_FOUND") == before + 1


def test_an_error_after_output_travels_in_band_then_ends_the_call() -> None:
    context = FakeContext()
    messages = asyncio.run(
        drain(chain(fails_after_one), CreateCompletionRequest(stream=True), context)
    )
    assert messages[0] == CHUNK
    assert messages[1].error.status_code == 404 and not messages[1].choices
    assert context.status == grpc.StatusCode.NOT_FOUND


async def cancelled(request: Any, context: Any) -> AsyncIterator[CreateCompletionResponse]:
    raise asyncio.CancelledError
    yield CHUNK


@pytest.mark.parametrize(
    ("remaining", "code"),
    [
        (-0.1, "DEADLINE_EXCEEDED"),
        # The client's deadline passes a little before the server's copy of it.
        (0.2, "DEADLINE_EXCEEDED"),
        (5.0, "CANCELLED"),
    ],
)
def test_a_cancelled_call_is_recorded_as_expired_only_at_its_deadline(
    remaining: float, code: str
) -> None:
    before = counted(code)
    with pytest.raises(asyncio.CancelledError):
        context = FakeContext(remaining=remaining)
        asyncio.run(drain(chain(cancelled), CreateCompletionRequest(), context))
    assert counted(code) == before + 1


def test_a_refusal_at_capacity_is_resource_exhausted_with_a_retry_hint_and_counted() -> None:
    async def overloaded(request: Any, context: Any) -> AsyncIterator[CreateCompletionResponse]:
        raise OverloadedError("The server is at capacity; retry after 1s.")
        yield CHUNK  # a generator, like the servicer's methods

    before = counted("RESOURCE_EXHAUSTED")
    context = FakeContext()
    assert asyncio.run(drain(chain(overloaded), CreateCompletionRequest(), context)) == []
    assert context.status == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert context.trailing["retry-after"] == "1"
    assert counted("RESOURCE_EXHAUSTED") == before + 1


def reported(context: FakeContext) -> OrcaLoadReport:
    return OrcaLoadReport.FromString(context.trailing["endpoint-load-metrics-bin"])


def test_a_served_call_ends_with_the_load_report() -> None:
    context = FakeContext()
    asyncio.run(drain(chain(two_chunks), CreateCompletionRequest(stream=True), context))
    report = reported(context)
    assert dict(report.named_metrics) == {
        "num_requests_running": 3,
        "num_requests_waiting": 5,
        "kv_cache_usage_perc": 0.25,
        "max_num_queued_reqs": 32,
        "adapter.sql": 1,  # in the engine's memory: a picker sends sql's new prompts here
    }
    assert report.application_utilization == 2.0  # 8 held over a batch of 4
    assert dict(report.utilization) == {"kv_cache": 0.25}


@pytest.mark.parametrize("servicer", [fails_at_once, fails_after_one])
def test_a_failed_call_ends_with_the_load_report_too(servicer: Any) -> None:
    context = FakeContext()
    asyncio.run(drain(chain(servicer), CreateCompletionRequest(stream=True), context))
    assert context.status == grpc.StatusCode.NOT_FOUND
    assert reported(context).named_metrics["num_requests_waiting"] == 5


@pytest.mark.parametrize(
    ("asked", "expected"),
    [
        ("text", "TEXT application_utilization=2.0, utilization.kv_cache=0.25, "),
        ("JSON", 'JSON {"application_utilization": 2.0, "utilization": {"kv_cache": 0.25}, '),
    ],
)
def test_a_caller_that_asks_gets_the_readable_report_in_a_header(asked: str, expected: str) -> None:
    context = FakeContext((("endpoint-load-metrics-format", asked),))
    asyncio.run(drain(chain(two_chunks), CreateCompletionRequest(stream=True), context))
    assert context.initial is not None
    header = dict(context.initial)["endpoint-load-metrics"]
    assert header.startswith(expected)
    assert "num_requests_waiting" in header


def test_no_readable_report_unless_asked() -> None:
    context = FakeContext()
    asyncio.run(drain(chain(two_chunks), CreateCompletionRequest(stream=True), context))
    assert context.initial is not None and "endpoint-load-metrics" not in dict(context.initial)


@pytest.mark.parametrize(
    ("request_message", "reply"),
    [
        (
            TokenizeRequest(model="m", prompt=struct_pb2.Value(string_value="Hi")),
            TokenizeResponse(),
        ),
        (CancelCompletionRequest(request_id="r"), CancelCompletionResponse(request_id="r")),
    ],
)
def test_with_prompts_logged_a_call_without_choices_is_served(
    request_message: Any, reply: Any
) -> None:
    """--log-prompts logs a call's prompt and output; methods whose replies carry no choices
    (tokenize, cancel) are served and logged all the same."""

    async def unary(request: Any, context: Any) -> AsyncIterator[Any]:
        yield reply

    interceptor = RequestContextInterceptor(METHODS, log_prompts=True)
    behaviour = ErrorMappingInterceptor(METHODS, 1 << 20, LoadReports(lambda: LOAD)).around
    context = FakeContext()
    served = asyncio.run(
        drain(
            lambda r, c: interceptor.around(
                lambda r2, c2: behaviour(unary, METHOD, r2, c2), METHOD, r, c
            ),
            request_message,
            context,
        )
    )
    assert served == [reply] and context.status is None


def test_a_count_the_event_loop_changes_while_scraped_never_fails_the_scrape() -> None:
    """vLLM's queued-token count iterates a dict the event loop changes: read from the metrics
    thread, it may raise; the gauge tries again, else keeps its last value."""
    outcomes = iter([7, RuntimeError("dictionary changed size during iteration"), 9])

    def read() -> int:
        outcome = next(outcomes)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    value = read_while_served(read)
    assert (value(), value()) == (7.0, 9.0)  # the second read tried again

    def always_changing() -> int:
        raise RuntimeError("dictionary changed size during iteration")

    stuck = read_while_served(always_changing)
    assert stuck() == 0.0


def test_a_callers_long_model_name_and_user_are_logged_cut_and_measured(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A request naming a model of 100,000 characters is answered (here: not found) and logged
    in one line of bounded length that says how long the name was."""
    request = CreateCompletionRequest(model="m" * 100_000, user="u" * 5_000)
    with caplog.at_level("INFO", logger="service.requests"):
        asyncio.run(drain(chain(fails_at_once), request, FakeContext()))
    (line,) = [r for r in caplog.records if r.name == "service.requests"]
    fields = line.fields  # type: ignore[attr-defined]
    assert fields["model"] == "m" * CALLER_TEXT_CHARS + "... (100000 characters)"
    assert fields["user"] == "u" * CALLER_TEXT_CHARS + "... (5000 characters)"
    short = CreateCompletionRequest(model="smollm2-135m-instruct", user="alice")
    caplog.clear()
    with caplog.at_level("INFO", logger="service.requests"):
        asyncio.run(drain(chain(two_chunks), short, FakeContext()))
    (line,) = [r for r in caplog.records if r.name == "service.requests"]
    fields = line.fields  # type: ignore[attr-defined]
    assert (fields["model"], fields["user"]) == ("smollm2-135m-instruct", "alice")


@pytest.mark.parametrize("log_prompts", [False, True])
def test_a_streams_first_and_last_message_are_timed_and_its_text_kept_when_logged(
    log_prompts: bool,
) -> None:
    """Only a stream's first message is looked at on its way (the time to it); the stream's end
    times its last. With prompts logged, every message's text is kept for the log line."""
    records: list[Any] = []

    async def three_chunks(request: Any, context: Any) -> AsyncIterator[CreateCompletionResponse]:
        records.append(current_record())
        for text in ("a", "b", "c"):
            yield CreateCompletionResponse(choices=[Choice(text=text)])
            await asyncio.sleep(0.02)

    interceptor = RequestContextInterceptor(METHODS, log_prompts=log_prompts)
    request = CreateCompletionRequest(model="m", stream=True)
    served = asyncio.run(
        drain(lambda r, c: interceptor.around(three_chunks, METHOD, r, c), request, FakeContext())
    )
    record = records[0]
    assert [message.choices[0].text for message in served] == ["a", "b", "c"]
    assert record.output == ("abc" if log_prompts else "")
    assert record.first_message_at is not None and record.last_message_at is not None
    assert record.last_message_at - record.first_message_at >= 0.035
