"""What each completion request leaves behind: one log line and Prometheus metrics.

The engine's own metrics (vllm:*: queue, KV-cache use, engine-side latencies and token
counts) are registered by vLLM in the same registry and served beside these.

A replica with several frontend processes keeps its metrics in prometheus_client's
multiprocess mode (PROMETHEUS_MULTIPROC_DIR, named before the first import of either:
service/transport/frontend_metrics.py): the parent serves one scrape, counters summed over the
frontends and the request counter labelled with the frontend that served; each frontend writes
its gauges' values every GAUGE_SECONDS.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.message import Message
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.multiprocess import MultiProcessCollector
from vllm.v1.engine.async_llm import AsyncLLM

from service.api.backlog import Backlog, ReplicaTally
from service.api.batch.runner import Owner
from service.transport.frontend_metrics import MULTIPROCESS_ENV
from service.transport.rest_bridge import END_OF_EVENTS

logger = logging.getLogger("service.requests")

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
TOKEN_GAP_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)

SEVERAL_FRONTENDS = MULTIPROCESS_ENV in os.environ
GAUGE_SECONDS = 0.25
READ_ATTEMPTS = 5  # reads of a count the event loop may be changing, per scrape
# A caller's own words in a request's log line and span (the model it named, its user field):
# at most this many characters, so that no request writes a line of 100 KB (a served model's
# name is far shorter). Prompts, logged only with --log-prompts, are kept whole.
CALLER_TEXT_CHARS = 256
FRONTEND: dict[str, str] = {}  # {"frontend": index} in a frontend of several

REQUESTS = Counter(
    "llmcompletions_requests",
    "Completion requests by gRPC method, final status and tenant ('' without one), and "
    "frontend with several",
    ["method", "code", "tenant", *(["frontend"] if SEVERAL_FRONTENDS else [])],
)
REQUEST_SECONDS = Histogram(
    "llmcompletions_request_duration_seconds",
    "End-to-end latency of a completion request",
    buckets=LATENCY_BUCKETS,
)
FIRST_MESSAGE_SECONDS = Histogram(
    "llmcompletions_time_to_first_token_seconds",
    "Time from the request to its first response message",
    buckets=LATENCY_BUCKETS,
)
# Observed once per request, not per message: the send path does no metric work per token.
TIME_PER_OUTPUT_TOKEN_SECONDS = Histogram(
    "llmcompletions_time_per_output_token_seconds",
    "Time per output token after the first of a streamed completion (one per request)",
    buckets=TOKEN_GAP_BUCKETS,
)
AUTH_FAILURES = Counter(
    "llmcompletions_auth_failures",
    "Calls refused for their key: missing (no bearer key) or unknown (no caller has it)",
    ["reason"],
)
TENANT_RELOADS = Counter(
    "llmcompletions_tenants_reloads",
    "Changes of the tenants file: reloaded, or refused (invalid, unreadable) keeping the table",
    ["result"],
)
RATE_LIMITED = Counter(
    "llmcompletions_rate_limited",
    "Calls refused because their tenant's limit (rpm or tpm) was spent",
    ["tenant", "limit"],
)
LIMITS_STORE_ERRORS = Counter(
    "llmcompletions_limits_store_errors",
    "Failed calls to the rate-limit store, by the error's type",
    ["error"],
)
PROMPT_TOKENS = Counter(
    "llmcompletions_prompt_tokens", "Prompt tokens of served requests, by tenant", ["tenant"]
)
CACHED_PROMPT_TOKENS = Counter(
    "llmcompletions_cached_prompt_tokens",
    "Prompt tokens of served requests found in the engine's prefix cache, by tenant",
    ["tenant"],
)
IMAGES = Counter("llmcompletions_images", "Images in served chat requests, by tenant", ["tenant"])
IMAGE_TOKENS = Counter(
    "llmcompletions_image_tokens",
    "Prompt tokens the images of served chat requests take (in prompt_tokens too), by tenant",
    ["tenant"],
)
BATCH_JOBS = Counter("llmcompletions_batch_jobs", "Batch jobs ended, by final status", ["status"])
BATCH_LINES = Counter(
    "llmcompletions_batch_lines", "Batch lines finished: completed, or failed", ["result"]
)
BATCH_TOKENS = Counter(
    "llmcompletions_batch_tokens",
    "Tokens of batch lines (in the prompt and completion token counts too), by tenant and kind",
    ["tenant", "kind"],
)
COMPLETION_TOKENS = Counter(
    "llmcompletions_completion_tokens",
    "Completion tokens generated for served requests, by tenant",
    ["tenant"],
)


# With several frontends, each gauge is the sum over the live ones (capacity: the same in all).
IN_FLIGHT = Gauge(
    "llmcompletions_requests_in_flight", "Calls being served", multiprocess_mode="livesum"
)
ENGINE_UNFINISHED = Gauge(
    "llmcompletions_engine_unfinished_requests",
    "Requests the engine has not finished (running or queued), read when scraped",
    multiprocess_mode="livesum",
)
QUEUED_PROMPT_TOKENS = Gauge(
    "llmcompletions_queued_prompt_tokens",
    "Prompt tokens of engine requests not yet past prefill (bounded by max_num_queued_tokens)",
    multiprocess_mode="livesum",
)
ADAPTER_RESIDENT = Gauge(
    "llmcompletions_adapter_resident",
    "1 for each LoRA adapter in the engine's memory now (vllm:lora_requests_info shows only "
    "those with requests), 0 once it left",
    ["adapter"],
    multiprocess_mode="max",
)
PREPARING = Gauge(
    "llmcompletions_requests_preparing",
    "Calls being validated and tokenized, not yet in the engine (nothing else waits here)",
    multiprocess_mode="livesum",
)
CAPACITY = Gauge(
    "llmcompletions_capacity",
    "The limits in force: the engine's batch (max_num_seqs, max_num_batched_tokens) and the "
    "backlog past which requests are refused (max_num_queued_reqs, max_num_queued_tokens)",
    ["limit"],
    multiprocess_mode="max",
)


def serve_metrics(host: str, port: int) -> None:
    start_http_server(port, addr=host)
    logger.info("metrics on http://%s:%d/metrics", host, port)


def serve_frontends_metrics(host: str, port: int) -> None:
    """In the parent of several frontends: one scrape of what they all wrote."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry)
    start_http_server(port, addr=host, registry=registry)
    logger.info("metrics of every frontend on http://%s:%d/metrics", host, port)


def label_frontend(index: int) -> None:
    FRONTEND["frontend"] = str(index)


def watch_engine_gauges(engine: AsyncLLM, backlog: Backlog) -> asyncio.Task[None] | None:
    """The engine's and the backlog's gauges: read when scraped, or with several frontends
    (whose scrape reads files) written every GAUGE_SECONDS by the task returned."""
    for limit, value in dataclasses.asdict(backlog.capacity).items():
        CAPACITY.labels(limit).set(value)
    if SEVERAL_FRONTENDS:
        return asyncio.ensure_future(write_gauges(engine, backlog))
    ENGINE_UNFINISHED.set_function(read_while_served(engine.get_num_unfinished_requests))
    QUEUED_PROMPT_TOKENS.set_function(read_while_served(engine.get_num_queued_tokens))
    PREPARING.set_function(lambda: backlog.preparing_calls)
    return None


def read_while_served(read: Callable[[], int]) -> Callable[[], float]:
    """`read` for the metrics thread. vLLM's counts iterate dicts that the event loop changes
    as requests come and go; a read that meets a change (RuntimeError) is tried again, and if
    it keeps meeting them, the last value read stands (a scrape never fails for it: it made
    /metrics answer 500 under a burst)."""
    last = 0.0

    def value() -> float:
        nonlocal last
        for _ in range(READ_ATTEMPTS):
            try:
                last = float(read())
                return last
            except RuntimeError:
                continue
        return last

    return value


async def write_gauges(engine: AsyncLLM, backlog: Backlog) -> None:
    while True:
        ENGINE_UNFINISHED.set(engine.get_num_unfinished_requests())
        QUEUED_PROMPT_TOKENS.set(engine.get_num_queued_tokens())
        PREPARING.set(backlog.preparing_calls)
        backlog.publish()  # prefill done meanwhile frees queued tokens for every frontend
        await asyncio.sleep(GAUGE_SECONDS)


def choice_text(choice: Any) -> str:
    """The text a completion choice or a chat choice (whole or delta) carries."""
    if hasattr(choice, "text"):
        return str(choice.text)
    said = choice.delta if choice.HasField("delta") else choice.message
    return str(said.content)


def caller_text(text: str) -> str:
    """`text` as logged: whole up to CALLER_TEXT_CHARS, else cut there, saying how long it was."""
    if len(text) <= CALLER_TEXT_CHARS:
        return text
    return f"{text[:CALLER_TEXT_CHARS]}... ({len(text)} characters)"


@dataclass
class RequestRecord:
    """One request's facts, filled in as it is served."""

    request_id: str
    method: str
    model: str
    user: str
    stream: bool
    principal: str = ""  # who called (service.transport.auth), "" without authentication
    tenant: str = ""  # the caller's tenant (the tenants file), "" without one
    key_id: str = ""  # the id of the tenant's key it called with
    reply_headers: tuple[tuple[str, str], ...] = ()  # added to the reply's headers (rate limits)
    # Told the prompt's tokens once tokenized (a tenant's limits charge them at once).
    on_tokenized: Callable[[int], None] | None = None
    trace_id: str = ""  # the call's trace, with tracing on
    started: float = field(default_factory=time.monotonic)
    first_message_at: float | None = None
    last_message_at: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    images: int = 0
    image_tokens: int = 0
    # For a batch job's line (service.transport.batch_lines): whose job it is, read once.
    line_owner: Owner | None = None
    prompts: list[str] | None = None  # only kept when prompts are logged
    output: str = ""

    def tokenized(self, prompt_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens
        if self.on_tokenized is not None:
            self.on_tokenized(prompt_tokens)

    def message_sent(self, message: Message) -> None:
        if message is END_OF_EVENTS:
            return  # the REST event stream's end sentinel: no content
        now = time.monotonic()
        if self.prompts is not None:
            # Only completions and chats have choices; the other methods' replies add nothing.
            choices = getattr(message, "choices", ())
            self.output += "".join(choice_text(choice) for choice in choices)
        if self.first_message_at is None:
            self.first_message_at = now
            FIRST_MESSAGE_SECONDS.observe(now - self.started)
        self.last_message_at = now

    def observe_time_per_output_token(self) -> None:
        if not self.stream or self.completion_tokens < 2 or self.first_message_at is None:
            return
        assert self.last_message_at is not None
        streamed = self.last_message_at - self.first_message_at
        TIME_PER_OUTPUT_TOKEN_SECONDS.observe(streamed / (self.completion_tokens - 1))

    def finish(self, code: str) -> None:
        """Count the request once, with its final status, and write its log line."""
        latency = time.monotonic() - self.started
        REQUESTS.labels(self.method, code, self.tenant, *FRONTEND.values()).inc()
        REQUEST_SECONDS.observe(latency)
        self.observe_time_per_output_token()
        PROMPT_TOKENS.labels(self.tenant).inc(self.prompt_tokens)
        CACHED_PROMPT_TOKENS.labels(self.tenant).inc(self.cached_tokens)
        COMPLETION_TOKENS.labels(self.tenant).inc(self.completion_tokens)
        if self.line_owner is not None:
            BATCH_TOKENS.labels(self.tenant, "prompt").inc(self.prompt_tokens)
            BATCH_TOKENS.labels(self.tenant, "completion").inc(self.completion_tokens)
        if self.images:
            IMAGES.labels(self.tenant).inc(self.images)
            IMAGE_TOKENS.labels(self.tenant).inc(self.image_tokens)
        fields: dict[str, Any] = {
            "request_id": self.request_id,
            "model": self.model,
            "user": self.user,
            "stream": self.stream,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "latency_s": round(latency, 4),
            "status": code,
        }
        if self.images:
            fields.update(images=self.images, image_tokens=self.image_tokens)
        if self.tenant:
            fields.update(tenant=self.tenant, key_id=self.key_id)
        if self.trace_id:
            fields["trace_id"] = self.trace_id
        if self.prompts is not None:
            fields.update(prompts=self.prompts, output=self.output)
        logger.info("request", extra={"fields": fields})


# The calls that generate: batch lines go after the others (service.api.batch.runner).
GENERATING_METHODS = frozenset({"CreateCompletion", "CreateChatCompletion"})


@dataclass
class InteractiveCalls:
    """This process's generating calls in flight that are not batch lines; with several
    frontends, published in the replica's tally, so that a batch job in any frontend yields to
    the calls of every one."""

    running: int = 0
    tally: ReplicaTally | None = None

    def add(self, change: int) -> None:
        self.running += change
        if self.tally is not None:
            self.tally.publish_interactive_calls(self.running)

    def in_replica(self) -> int:
        return self.tally.interactive_calls() if self.tally is not None else self.running


INTERACTIVE_CALLS = InteractiveCalls()


class BatchMetrics:
    """Batch jobs' lines and ends, counted (service.api.batch.runner.BatchCounts)."""

    def line_finished(self, result: str) -> None:
        BATCH_LINES.labels(result).inc()

    def job_ended(self, status: str) -> None:
        BATCH_JOBS.labels(status).inc()


def counted_limit(kind: str, detail: str) -> None:
    """A refusal by a tenant's limit ("rpm", "tpm"; detail: the tenant) or a store error."""
    if kind == "store":
        LIMITS_STORE_ERRORS.labels(error=detail).inc()
    else:
        RATE_LIMITED.labels(tenant=detail, limit=kind).inc()


def publish_resident_adapters(names: list[str]) -> Callable[[str, bool], None]:
    """Sets the adapters given at start as resident; returns what to tell of each change."""
    for name in names:
        ADAPTER_RESIDENT.labels(name).set(1)
    return lambda name, held: ADAPTER_RESIDENT.labels(name).set(1 if held else 0)
