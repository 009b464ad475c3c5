"""The gRPC server's lifecycle: listen at once, load the engine, serve, drain on a signal."""

from __future__ import annotations

import asyncio
import logging
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from llmcompletions.v2 import completions_pb2, completions_pb2_grpc

from service.adapters import AdapterError, load_adapters
from service.admission import Admission, AdmissionInterceptor
from service.auth import ApiKeyInterceptor
from service.completions import CompletionHandler
from service.engine import ServedModel, start_engine
from service.error_mapping import ErrorMappingInterceptor
from service.interception import StreamInterceptor
from service.observability import serve_metrics, watch_engine_gauges
from service.request_context import RequestContextInterceptor
from service.servicer import CompletionServicer
from service.settings import EngineSettings, ServerSettings

logger = logging.getLogger(__name__)

COMPLETION_SERVICE = completions_pb2.DESCRIPTOR.services_by_name["CompletionService"].full_name
COMPLETION_METHOD = f"/{COMPLETION_SERVICE}/CreateCompletion"
ENGINE_CHECK_SECONDS = 1.0
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class ServiceState:
    """What the servicer sees of the engine: nothing until it is ready."""

    def __init__(self) -> None:
        self.handler: CompletionHandler | None = None


def interceptor_chain(settings: ServerSettings) -> list[StreamInterceptor]:
    """Outermost first: request context -> authentication -> admission -> error mapping."""
    methods = frozenset({COMPLETION_METHOD})
    chain: list[StreamInterceptor] = [RequestContextInterceptor(methods, settings.log_prompts)]
    if settings.api_key:
        chain.append(ApiKeyInterceptor(methods, settings.api_key))
    chain.append(
        AdmissionInterceptor(methods, Admission(settings.max_in_flight, settings.max_waiting))
    )
    chain.append(ErrorMappingInterceptor(methods, settings.max_message_bytes))
    return chain


def build_server(
    settings: ServerSettings, state: ServiceState
) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    server = grpc.aio.server(
        interceptors=interceptor_chain(settings),
        options=[
            ("grpc.max_receive_message_length", settings.max_message_bytes),
            ("grpc.max_send_message_length", settings.max_message_bytes),
        ],
    )
    completions_pb2_grpc.add_CompletionServiceServicer_to_server(
        CompletionServicer(lambda: state.handler), server
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [COMPLETION_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    address = f"{settings.host}:{settings.port}"
    if server.add_insecure_port(address) == 0:
        raise SystemExit(
            f"cannot listen on {address}: is the port in use? Pick another with --port"
        )
    return server, health_servicer


async def set_health(health_servicer: health.aio.HealthServicer, status: int) -> None:
    for name in ("", COMPLETION_SERVICE):
        await health_servicer.set(name, status)


async def serve(server_settings: ServerSettings, engine_settings: EngineSettings) -> int:
    """Run until SIGINT or SIGTERM; return the process exit code."""
    state = ServiceState()
    server, health_servicer = build_server(server_settings, state)
    if server_settings.metrics_port is not None:
        serve_metrics(server_settings.metrics_host, server_settings.metrics_port)
    await server.start()
    await set_health(health_servicer, NOT_SERVING)
    logger.info(
        "gRPC listening on %s:%d; loading the engine", server_settings.host, server_settings.port
    )

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)

    model: ServedModel | None = None
    loading = asyncio.ensure_future(asyncio.to_thread(start_engine, engine_settings))
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
        state.handler = CompletionHandler(model, server_settings.limits)
        watch_engine_gauges(model.engine)
        await set_health(health_servicer, SERVING)
        logger.info("serving model %s", model.name)
        if await until_stopped_or_engine_dead(model, stopping):
            logger.error("the engine died: refusing new requests and exiting for a restart")
            state.handler = None
            exit_code = 1

    logger.info("shutting down: draining for up to %.0fs", server_settings.shutdown_grace_seconds)
    await set_health(health_servicer, NOT_SERVING)
    if exit_code == 0 and server_settings.drain_delay_seconds > 0:
        # Keep serving while load balancers' health checks see NOT_SERVING and stop sending.
        await asyncio.sleep(server_settings.drain_delay_seconds)
    await server.stop(server_settings.shutdown_grace_seconds)
    if model is not None:
        model.engine.shutdown()
    logger.info("stopped")
    return exit_code


async def adapters_loaded(model: ServedModel) -> bool:
    """Load the adapters into the engine; False (and a one-line error) if one fails."""
    try:
        await load_adapters(model.engine, model.catalog)
    except AdapterError as error:
        logger.error("%s", error)
        return False
    return True


async def until_stopped_or_engine_dead(model: ServedModel, stopping: asyncio.Future) -> bool:
    """Wait for a stop signal; True if the engine died first."""
    while not stopping.done():
        if model.engine.errored:
            return True
        await asyncio.wait({stopping}, timeout=ENGINE_CHECK_SECONDS)
    return False
