"""The gRPC server's lifecycle: listen at once, load the engine, serve, drain on a signal."""

from __future__ import annotations

import asyncio
import logging
import shutil
import signal
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path

import grpc
import uvloop
from google.protobuf.message import Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from llmcompletions.v2 import completions_pb2, completions_pb2_grpc
from vllm.utils.gc_utils import freeze_gc_heap

from plumbing.call_backlog import call_backlog_options
from plumbing.keepalive import server_options
from plumbing.tls import server_credentials
from plumbing.tracing import flush_tracing, start_tracing
from service.api.adapter_admin import AdapterAdmin
from service.api.backlog import Backlog, ReplicaTally
from service.api.batch.job_request import EngineFacts
from service.api.batch.jobs import BatchJobs
from service.api.batch.runner import Runner
from service.api.batch.store import JobStore
from service.api.cancellation import Cancellations
from service.api.chat import ChatHandler
from service.api.completions import CompletionHandler
from service.api.endpoint_models import check_served
from service.api.model_listing import ModelListing
from service.api.rate_limits import TenantLimits
from service.api.tokenization import Tokenization
from service.model.adapter_checks import AdapterError
from service.model.adapters import load_adapters
from service.model.engine import ServedModel, start_engine
from service.model.in_core_worker import may_run_worker_in_core
from service.model.load import LoadSnapshot
from service.model.standby_core import ENGINE_CORE_MODULES, Standby, stand_by
from service.settings import BatchSettings, EngineSettings, ServerSettings
from service.transport.auth import ApiKeyInterceptor, OperatorKeyInterceptor
from service.transport.batch_lines import GrpcLineCaller
from service.transport.batch_servicer import BatchServicer
from service.transport.error_mapping import ErrorMappingInterceptor
from service.transport.frontend import FrontendRole
from service.transport.interception import StreamInterceptor
from service.transport.key_order import KeyOrderInterceptor
from service.transport.load_reports import LoadReports
from service.transport.observability import (
    INTERACTIVE_CALLS,
    TENANT_RELOADS,
    BatchMetrics,
    counted_limit,
    label_frontend,
    publish_resident_adapters,
    serve_metrics,
    watch_engine_gauges,
)
from service.transport.request_context import RequestContextInterceptor
from service.transport.servicer import CompletionServicer, Serving
from service.transport.tenant_limits import TenantLimitsInterceptor
from service.transport.tenants_file import TenantsFile

logger = logging.getLogger(__name__)

SERVICE_DESCRIPTOR = completions_pb2.DESCRIPTOR.services_by_name["CompletionService"]
COMPLETION_SERVICE = SERVICE_DESCRIPTOR.full_name
BATCH_DESCRIPTOR = completions_pb2.DESCRIPTOR.services_by_name["BatchCompletionService"]
BATCH_SERVICE = BATCH_DESCRIPTOR.full_name


def method_names(*names: str, service: str = COMPLETION_SERVICE) -> frozenset[str]:
    return frozenset(f"/{service}/{name}" for name in names)


BATCH_METHODS = method_names(
    *(method.name for method in BATCH_DESCRIPTOR.methods), service=BATCH_SERVICE
)
ALL_METHODS = method_names(*(method.name for method in SERVICE_DESCRIPTOR.methods)) | BATCH_METHODS
# The calls that do work (a drain waits for them); describing the models is cheap.
WORKING_METHODS = method_names("CreateCompletion", "CreateChatCompletion", "Tokenize", "Detokenize")
# The operator's calls: only an operator key may make them.
ADAPTER_METHODS = method_names("LoadLoraAdapter", "UnloadLoraAdapter")
# The calls a tenant's limits count (and whose tokens they charge).
LIMITED_METHODS = method_names("CreateCompletion", "CreateChatCompletion")
ENGINE_CHECK_SECONDS = 1.0
# Batch lines run after every interactive call (vLLM runs lower priorities first) ...
BATCH_PRIORITY = 2**31 - 1
# ... and at most this share of the engine's batch of them at once.
BATCH_WINDOW_SHARE = 2
# A drain takes the completion calls in flight as finished once none has run for this long,
# so that a call the server accepted just before closing its listener is counted too.
QUIET_SECONDS = 0.1
# Calls cancelled when the grace period runs out get this long to end (and abort their
# engine requests) before the engine stops.
CANCEL_WAIT_SECONDS = 2.0
# On every span of a frontend of several (a resource attribute): which one served.
FRONTEND_ATTRIBUTE = "llm_completions.frontend"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class CallTracker(grpc.aio.ServerInterceptor):
    """Knows which calls of `methods` are being served (the asyncio task serving each), so
    that a drain can wait for them alone, and cancel them if the grace period runs out."""

    def __init__(self, methods: frozenset[str]) -> None:
        self._methods = methods
        self.tasks: set[asyncio.Task[object]] = set()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        # gRPC runs interceptors inside the task that then serves the call.
        task = asyncio.current_task()
        if handler_call_details.method in self._methods and task is not None:
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        return await continuation(handler_call_details)

    async def wait_until_quiet(self) -> None:
        """Until no call has been in flight for QUIET_SECONDS."""
        while True:
            if self.tasks:
                await asyncio.wait(set(self.tasks))
            await asyncio.sleep(QUIET_SECONDS)
            if not self.tasks:
                return

    async def cancel(self, timeout: float) -> None:
        for task in self.tasks:
            task.cancel()
        if self.tasks:
            await asyncio.wait(set(self.tasks), timeout=timeout)


class ServiceState:
    """What the servicer sees of the engine: nothing until it is ready."""

    def __init__(self, tenants: TenantsFile | None = None) -> None:
        self.serving: Serving | None = None
        self.model: ServedModel | None = None
        self.tenants = tenants  # the tenants file, followed while serving
        self.batch: BatchJobs | None = None
        # This process's own socket, for its batch jobs' lines (service.transport.batch_lines).
        self.line_socket = str(Path(tempfile.mkdtemp(prefix="llmc-lines-")) / "lines.sock")

    def load(self) -> LoadSnapshot | None:
        """The engine's load now, for the replies' load reports."""
        if self.model is None:
            return None
        now = self.model.load.snapshot(self.model.engine)
        return replace(now, adapters=tuple(self.model.adapters.resident_names()))


def interceptor_chain(settings: ServerSettings, state: ServiceState) -> list[StreamInterceptor]:
    """Outermost first: request context -> authentication -> error mapping -> tenant limits
    (with a tenants file). Nothing holds a
    call back here: the serving logic refuses what passes the backlog bounds
    (service.api.backlog)."""
    chain: list[StreamInterceptor] = [
        RequestContextInterceptor(
            ALL_METHODS, settings.log_prompts, traced=settings.tracing is not None
        )
    ]
    if settings.api_key or state.tenants is not None:
        caller_methods = ALL_METHODS - ADAPTER_METHODS
        chain.append(ApiKeyInterceptor(caller_methods, settings.api_key, state.tenants))
    chain.append(OperatorKeyInterceptor(ADAPTER_METHODS, settings, state.tenants))
    reports = LoadReports(state.load)
    chain.append(ErrorMappingInterceptor(ALL_METHODS, settings.max_message_bytes, reports))
    if state.tenants is not None:  # inside the error mapping: a refusal is a 429
        limits = TenantLimits(settings.limits_store, settings.limits_fail_closed, counted_limit)
        chain.append(TenantLimitsInterceptor(LIMITED_METHODS, limits))
    return chain


def build_server(
    settings: ServerSettings,
    state: ServiceState,
    calls: CallTracker,
    role: FrontendRole | None = None,
) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    server = grpc.aio.server(
        interceptors=[KeyOrderInterceptor(), calls, *interceptor_chain(settings, state)],
        options=[
            ("grpc.max_receive_message_length", settings.max_message_bytes),
            ("grpc.max_send_message_length", settings.max_message_bytes),
            # A second server on the same port fails to start instead of sharing it, e.g. a
            # replica restarted while the old process still drains; the frontends of one
            # replica share its port (the parent checked that the ports were free).
            ("grpc.so_reuseport", 0 if role is None else 1),
            *server_options(settings.keepalive),
            *call_backlog_options(),
        ],
    )
    siblings = None if role is None else role.siblings()
    completions_pb2_grpc.add_CompletionServiceServicer_to_server(
        CompletionServicer(lambda: state.serving, siblings), server
    )
    completions_pb2_grpc.add_BatchCompletionServiceServicer_to_server(
        BatchServicer(lambda: state.batch), server
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [COMPLETION_SERVICE, BATCH_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    server.add_insecure_port(f"unix:{state.line_socket}")
    for address in listening_addresses(settings, role):
        listen(server, address, settings)
    if role is not None:  # the other frontends' cancels, from this host only
        server.add_insecure_port(f"unix:{role.own_socket}")
    return server, health_servicer


def listening_addresses(settings: ServerSettings, role: FrontendRole | None) -> list[str]:
    """The replica's port, and a frontend's own as well."""
    ports = [settings.port] if role is None else [settings.port, role.own_port]
    return [f"{settings.host}:{port}" for port in ports]


def listen(server: grpc.aio.Server, address: str, settings: ServerSettings) -> None:
    try:
        if settings.tls is None:
            bound = server.add_insecure_port(address)
        else:  # health checks and reflection are served over the same TLS
            bound = server.add_secure_port(address, server_credentials(settings.tls))
    except RuntimeError:  # what grpc raises when the port is taken
        bound = 0
    if bound == 0:
        raise SystemExit(
            f"cannot listen on {address}: is the port in use? Pick another with --port"
        )


def serving(
    model: ServedModel, settings: ServerSettings, tally: ReplicaTally | None = None
) -> Serving:
    backlog = Backlog(model.engine, model.capacity, tally)
    completions = CompletionHandler(
        model, settings.limits, backlog, always_metrics=settings.per_request_metrics
    )
    chat = ChatHandler(model, settings.limits, backlog, settings.chat, settings.per_request_metrics)
    tokenization = Tokenization(model, settings.limits, completions.tokenizing, backlog, chat)
    cancellations = Cancellations(model)
    settings_of = model.adapters.settings
    admin = AdapterAdmin(
        model, settings_of.enable_adapter_loading, settings_of.adapter_drain_seconds
    )
    return Serving(completions, chat, ModelListing(model), tokenization, cancellations, admin)


def batch_jobs(
    model: ServedModel, serving: Serving, settings: BatchSettings, line_socket: str
) -> BatchJobs:
    """Batch jobs on this engine: their lines run through this process's own methods, half
    the engine's batch at a time, at the lowest priority when it schedules by one."""
    priority = BATCH_PRIORITY if model.scheduling_policy == "priority" else None
    runner = Runner(
        JobStore(settings.root),
        GrpcLineCaller(line_socket, priority),
        window=max(1, model.capacity.max_num_seqs // BATCH_WINDOW_SHARE),
        counts=BatchMetrics(),
        interactive_calls=INTERACTIVE_CALLS.in_replica,
    )
    engine = EngineFacts(model.max_model_len, model.engine.model_config.quantization)

    def validate_line(kind: str, request: Message) -> None:
        handler = serving.chat if kind == "chat" else serving.completions
        handler.check(request)  # type: ignore[arg-type]
        check_served(model.adapters, request.model)  # type: ignore[attr-defined]

    return BatchJobs(settings, runner, engine, validate_line, model.adapters.serves)


async def set_health(health_servicer: health.aio.HealthServicer, status: int) -> None:
    for name in ("", COMPLETION_SERVICE):
        await health_servicer.set(name, status)


def run_server(
    server_settings: ServerSettings,
    engine_settings: EngineSettings,
    role: FrontendRole | None = None,
) -> int:
    """Serve until stopped; the exit code. Not asyncio.run: its teardown is what exit_now
    skips. uvloop, as vLLM's own server: each streamed token wakes the loop twice (the engine's
    output, then gRPC's write completing), and uvloop's wake-ups cost less
    (docs/benchmarks/where-the-cpu-goes.md)."""
    # Before the first thread and socket: the engine core's copy of this process.
    core_copy = role is None and may_run_worker_in_core(engine_settings)
    copies = stand_by(int(core_copy), ENGINE_CORE_MODULES if core_copy else ())
    standby = copies[0] if copies else None
    loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    return loop.run_until_complete(serve(server_settings, engine_settings, role, standby))


async def serve(
    server_settings: ServerSettings,
    engine_settings: EngineSettings,
    role: FrontendRole | None = None,
    standby: Standby | None = None,
) -> int:
    """Run until SIGINT or SIGTERM; return the process exit code. With a `role`, as one of
    several frontends over an engine core that the parent process runs (and whose metrics it
    serves); else with the `standby` copy of this process to run the engine core, if any."""
    if server_settings.tracing is not None:  # before the engine's: vLLM's spans go with ours
        frontend = {} if role is None else {FRONTEND_ATTRIBUTE: str(role.link.index)}
        start_tracing(server_settings.tracing, frontend)
    tenants = None
    if server_settings.tenants_file is not None:
        tenants = TenantsFile(server_settings.tenants_file, counted_reload)
    state = ServiceState(tenants)
    calls = CallTracker(WORKING_METHODS)
    server, health_servicer = build_server(server_settings, state, calls, role)
    if role is not None:
        label_frontend(role.link.index)
    elif server_settings.metrics_port is not None:
        serve_metrics(server_settings.metrics_host, server_settings.metrics_port)
    await server.start()
    await set_health(health_servicer, NOT_SERVING)
    logger.info(
        "gRPC listening on %s (%s); loading the engine",
        ", ".join(listening_addresses(server_settings, role)),
        describe_transport(server_settings),
    )

    following = None if tenants is None else asyncio.ensure_future(tenants.follow())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)

    model: ServedModel | None = None
    gauges: asyncio.Task[None] | None = None
    adapter_root: asyncio.Task[None] | None = None
    batch_takeover: asyncio.Future[None] | None = None
    link = None if role is None else role.link
    loading = asyncio.ensure_future(asyncio.to_thread(start_engine, engine_settings, link, standby))
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
    exit_code = 0
    if loading.done():
        try:
            model = loading.result()
        except Exception:
            logger.exception("the engine failed to start; check --model and the engine arguments")
            exit_code = 1
    if model is not None and not await adapters_loaded(model):
        exit_code = 1
    if model is not None and exit_code == 0:
        tally = None if role is None else role.tally()
        state.serving = serving(model, server_settings, tally)
        INTERACTIVE_CALLS.tally = tally
        state.model = model
        gauges = watch_engine_gauges(model.engine, state.serving.completions.backlog)
        model.adapters.on_residency = publish_resident_adapters(model.adapters.resident_names())
        if engine_settings.adapter_root is not None:
            adapter_root = asyncio.ensure_future(model.adapters.watch_root())
        # As vLLM's own server does once it is up: the objects made at start (the model's
        # config, the tokenizer, the modules) leave the garbage collector's generations, so
        # its collections while serving walk only what requests allocate.
        freeze_gc_heap()
        state.batch = batch_jobs(model, state.serving, server_settings.batch, state.line_socket)
        await set_health(health_servicer, SERVING)
        logger.info("serving model %s", model.name)
        if resumed := state.batch.resume():
            logger.info("resuming %d unfinished batch jobs", resumed)
        batch_takeover = asyncio.ensure_future(state.batch.take_over())
        if await until_stopped_or_engine_dead(model, stopping):
            logger.error("the engine died: refusing new requests and exiting for a restart")
            state.serving = None
            exit_code = 1

    logger.info(
        "shutting down: draining for up to %.0fs (%d requests in flight)",
        server_settings.shutdown_grace_seconds,
        len(calls.tasks),
    )
    await set_health(health_servicer, NOT_SERVING)
    if state.batch is not None:  # their lines in flight run again at the next start
        await state.batch.runner.stop_all()
    if exit_code == 0 and server_settings.drain_delay_seconds > 0:
        # Keep serving while load balancers' health checks see NOT_SERVING and stop sending.
        await asyncio.sleep(server_settings.drain_delay_seconds)
    await drain(server, calls, server_settings.shutdown_grace_seconds)
    for task in (gauges, following, adapter_root, batch_takeover):
        if task is not None:
            task.cancel()
    if model is not None:
        model.engine.shutdown(timeout=server_settings.engine_stop_seconds)
    if server_settings.tracing is not None:
        flush_tracing()
    shutil.rmtree(Path(state.line_socket).parent, ignore_errors=True)
    logger.info("stopped")
    return exit_code


def describe_transport(settings: ServerSettings) -> str:
    keepalive = settings.keepalive
    security = "plaintext"
    if settings.tls is not None:
        security = "mutual TLS" if settings.tls.mutual else "TLS"
    return (
        f"{security}; keepalive pings after {keepalive.time_seconds:g}s idle, "
        f"{keepalive.timeout_seconds:g}s to answer"
    )


async def adapters_loaded(model: ServedModel) -> bool:
    """Load the adapters into the engine; False (and a one-line error) if one fails."""
    try:
        await load_adapters(model.engine, model.adapters.catalog)
    except AdapterError as error:
        logger.error("%s", error)
        return False
    return True


async def drain(server: grpc.aio.Server, calls: CallTracker, grace: float) -> None:
    """Close the listener, let the completion calls in flight finish (for up to `grace`
    seconds), then end the rest at once. grpc's own stop(grace) also waits for every other
    call and connection to end: a health Watch stream held it for the whole grace period, a
    client connection that stays silent (never answers the server's GOAWAY ping) for 20 s."""
    loop = asyncio.get_running_loop()
    closed_at = loop.time()
    logger.info("closing the listener; %d requests in flight", len(calls.tasks))
    stopping = asyncio.ensure_future(server.stop(grace))
    quiet = asyncio.ensure_future(calls.wait_until_quiet())
    done, _ = await asyncio.wait(
        {stopping, quiet}, timeout=grace, return_when=asyncio.FIRST_COMPLETED
    )
    quiet.cancel()
    if done:
        logger.info(
            "requests in flight finished %.1fs after the listener closed", loop.time() - closed_at
        )
    else:
        logger.warning(
            "grace period (%.0fs) over: cancelling %d requests in flight", grace, len(calls.tasks)
        )
    await server.stop(None)  # ends what is left: idle connections, Watch streams
    await calls.cancel(CANCEL_WAIT_SECONDS)  # none are left unless the grace period ran out
    await stopping


async def until_stopped_or_engine_dead(model: ServedModel, stopping: asyncio.Future) -> bool:
    """Wait for a stop signal; True if the engine died first."""
    while not stopping.done():
        if model.engine.errored:
            return True
        await asyncio.wait({stopping}, timeout=ENGINE_CHECK_SECONDS)
    return False


def counted_reload(result: str) -> None:
    TENANT_RELOADS.labels(result=result).inc()
