"""One trace per request across the fleet, in a real OTLP receiver: a REST call through Envoy,
the replica picker and one of two replicas, down to vLLM's own request span, continuing the
caller's `traceparent`; a gRPC caller's trace continued the same way; a failed call marked so;
and a collector that is down costs a request nothing."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import httpx
import pytest
from llmcompletions.v2 import completions_pb2_grpc

from tests.conftest import MODEL, TRACE_BATCH_ENV, FleetReplicas
from tests.helpers import body, grpc_request
from tests.otlp import SERVER_KIND, OtlpReceiver, ReceivedSpan, caller_context, children, named
from tests.test_prefix_routing import Fleet, facade

SERVICE_SPAN = "llmcompletions.v2.CompletionService/CreateCompletion"
PICKER_CALL = "async envoy.service.ext_proc.v3.ExternalProcessor.Process egress"
# Envoy's clock and the service's are the host's; vLLM stamps its span from its own reading.
CLOCK_SLACK_NS = 5_000_000
# Without a collector a request takes what it takes with one (measured: about 0.3 s for this
# one on an idle replica); spans are sent in the background.
DOWN_COLLECTOR_SECONDS = 5.0


@dataclass
class TracedFleet:
    receiver: OtlpReceiver
    fleet: Fleet


@pytest.fixture(scope="module")
def traced(fleet_replicas: FleetReplicas) -> Iterator[TracedFleet]:
    """The session's fleet (its replicas send their spans to its receiver) behind an Envoy
    and a picker of this module's that send theirs there too."""
    receiver = fleet_replicas.receiver
    with pytest.MonkeyPatch.context() as environment:
        for name, value in TRACE_BATCH_ENV.items():
            environment.setenv(name, value)  # Envoy's picker, started by facade.launch
        with facade(fleet_replicas.replicas, "--otlp-traces-endpoint", receiver.endpoint) as fleet:
            yield TracedFleet(receiver, fleet)


def served_to_the_engine(spans: list[ReceivedSpan]) -> bool:
    return any(s.name == "llm_request" for s in spans) and any(
        s.service == "llm-completions-envoy" and s.name == "ingress" for s in spans
    )


def one_child(spans: list[ReceivedSpan], parent: ReceivedSpan, name: str) -> ReceivedSpan:
    (child,) = [s for s in children(spans, parent) if s.name == name]
    return child


def assert_service_subtree(spans: list[ReceivedSpan], call: ReceivedSpan) -> ReceivedSpan:
    """The service's call span has its two children, and vLLM's span is under the engine's
    (and within it in time); returns vLLM's."""
    assert call.kind == SERVER_KIND and call.service == "llm-completions"
    one_child(spans, call, "validate and tokenize")
    engine = one_child(spans, call, "engine")
    vllm = one_child(spans, engine, "llm_request")
    assert engine.start_ns - CLOCK_SLACK_NS <= vllm.start_ns
    assert vllm.end_ns <= engine.end_ns + CLOCK_SLACK_NS
    assert vllm.attributes["gen_ai.latency.time_in_queue"] >= 0
    return vllm


def test_a_rest_call_is_one_trace_from_envoy_through_the_picker_to_the_engine(
    traced: TracedFleet,
) -> None:
    trace_id, caller_span, traceparent = caller_context()
    request_id = f"traced-{uuid.uuid4().hex[:8]}"
    reply = httpx.post(
        f"{traced.fleet.base_url}/v2/completions",
        json=body(prompt="A traced request", max_tokens=4),
        headers={"traceparent": traceparent, "x-request-id": request_id},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-request-id"] == request_id  # kept as the caller sent it
    usage = reply.json()["usage"]
    spans = traced.receiver.wait_for(trace_id, served_to_the_engine)

    ingress = named(spans, "ingress")
    assert ingress.parent_id == caller_span and ingress.service == "llm-completions-envoy"
    # The picker's decision, under Envoy's call to it.
    pick = named(spans, "pick replica")
    assert pick.service == "llm-completions-picker"
    assert named(spans, PICKER_CALL).parent_id == ingress.span_id
    assert pick.parent_id == named(spans, PICKER_CALL).span_id
    assert pick.attributes["llm_completions.replica"] == reply.headers["x-upstream-host"]
    assert pick.attributes["llm_completions.pick"] == "prefix"
    assert "llm_completions.replica_load" in pick.attributes
    # The replica's span, under Envoy's call to that replica.
    call = named(spans, SERVICE_SPAN)
    upstream = next(s for s in spans if s.span_id == call.parent_id)
    assert upstream.parent_id == ingress.span_id and upstream.name.startswith("router ")
    vllm = assert_service_subtree(spans, call)
    assert call.attributes["llm_completions.request_id"] == request_id
    assert call.attributes["gen_ai.request.model"] == MODEL
    assert call.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert call.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert call.attributes["rpc.grpc.status_code"] == 0
    assert vllm.attributes["gen_ai.usage.completion_tokens"] == usage["completion_tokens"]
    assert {s.trace_id for s in spans} == {trace_id}


def test_a_call_without_traceparent_starts_its_own_trace_each(traced: TracedFleet) -> None:
    """Envoy starts a trace per request; vLLM's span of the second goes to the second."""
    trace_ids = []
    for _ in range(2):
        reply = httpx.post(
            f"{traced.fleet.base_url}/v2/completions",
            json=body(prompt="An untraced caller", max_tokens=2),
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        request_id = reply.headers["x-request-id"]
        trace_ids.append(trace_of(traced.receiver, request_id))
    assert trace_ids[0] != trace_ids[1]
    for trace_id in trace_ids:
        spans = traced.receiver.wait_for(trace_id, served_to_the_engine)
        assert named(spans, "ingress").parent_id == ""  # Envoy started it
        assert_service_subtree(spans, named(spans, SERVICE_SPAN))


def trace_of(receiver: OtlpReceiver, request_id: str, timeout: float = 20) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for span in receiver.spans():
            if span.attributes.get("llm_completions.request_id") == request_id:
                return span.trace_id
        time.sleep(0.2)
    raise AssertionError(f"no span of request {request_id}")


def test_a_grpc_callers_trace_continues_into_the_replica_and_its_log(
    traced: TracedFleet,
) -> None:
    trace_id, caller_span, traceparent = caller_context()
    replica = traced.fleet.replicas[0]
    with grpc.insecure_channel(replica.grpc_target) as channel:
        stub = completions_pb2_grpc.CompletionServiceStub(channel)
        request = grpc_request(prompt="A traced gRPC call", max_tokens=3, stream=True)
        list(stub.CreateCompletion(request, metadata=(("traceparent", traceparent),)))
    spans = traced.receiver.wait_for(
        trace_id, lambda found: any(s.name == "llm_request" for s in found)
    )
    call = named(spans, SERVICE_SPAN)
    assert call.parent_id == caller_span
    assert call.attributes["llm_completions.stream"] is True
    assert_service_subtree(spans, call)
    assert replica.service_log is not None
    logged = [line for line in replica.service_log.read_text().splitlines() if trace_id in line]
    assert len(logged) == 1 and "request" in logged[0]


def test_a_refused_call_is_a_failed_span_with_its_status(traced: TracedFleet) -> None:
    trace_id, _, traceparent = caller_context()
    reply = httpx.post(
        f"{traced.fleet.base_url}/v2/completions",
        json=body(prompt="x", max_tokens=-1),
        headers={"traceparent": traceparent},
        timeout=60,
    )
    assert reply.status_code == 422
    spans = traced.receiver.wait_for(
        trace_id, lambda found: any(s.name == SERVICE_SPAN for s in found)
    )
    call = named(spans, SERVICE_SPAN)
    assert call.status == 2  # error
    assert call.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert named(spans, "validate and tokenize").status == 2
    assert not [s for s in spans if s.name in ("engine", "llm_request")]


def test_a_collector_that_is_down_costs_a_request_nothing(traced: TracedFleet) -> None:
    """Last of the fleet's tests that read spans: it stops the fleet's receiver."""
    traced.receiver.stop()
    for _ in range(3):
        started = time.monotonic()
        reply = httpx.post(
            f"{traced.fleet.base_url}/v2/completions",
            json=body(prompt="Nobody is listening", max_tokens=3),
            headers={"traceparent": caller_context()[2]},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        assert time.monotonic() - started < DOWN_COLLECTOR_SECONDS
