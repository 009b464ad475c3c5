"""The gRPC servicer: hands requests to the completion handler and maps errors to statuses."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import grpc
from google.protobuf import json_format
from grpc_status import rpc_status
from llmcompletions.v2 import completions_pb2_grpc
from llmcompletions.v2.completions_pb2 import CreateCompletionRequest, CreateCompletionResponse

from service.admission import Admission
from service.completions import CompletionHandler
from service.errors import (
    CompletionError,
    EngineUnavailableError,
    InternalError,
    ReplyTooLargeError,
)
from service.faults import requested_fault
from service.observability import RequestRecord
from service.request_identity import REQUEST_ID_HEADER, request_id
from service.responses import stream_error_chunk
from service.rest_bridge import END_OF_EVENTS, RestCall, error_metadata, rest_call

logger = logging.getLogger(__name__)


METHOD = "CreateCompletion"


class CompletionServicer(completions_pb2_grpc.CompletionServiceServicer):
    def __init__(
        self,
        handler: Callable[[], CompletionHandler | None],
        admission: Admission,
        max_message_bytes: int,
        log_prompts: bool = False,
        fault_injection: bool = False,
    ) -> None:
        self._handler = handler  # None until the engine is ready
        self._admission = admission
        self._max_message_bytes = max_message_bytes
        self._log_prompts = log_prompts
        self._fault_injection = fault_injection

    async def CreateCompletion(
        self, request: CreateCompletionRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[CreateCompletionResponse]:
        rest = rest_call(context.invocation_metadata())
        record = self.record(request, request_id(context))
        identity = ((REQUEST_ID_HEADER, record.request_id),)
        sent_any = False
        failure: CompletionError | None = None
        fail_after = requested_fault(context) if self._fault_injection else None
        try:
            async with self._admission.slot():
                async for message in self.handler().complete(request, record, fail_after):
                    self.check_size(message, request.stream, rest)
                    if not sent_any:
                        framing = rest.framing(request.stream) if rest else ()
                        await context.send_initial_metadata(identity + framing)
                    sent_any = True
                    record.message_sent(message)
                    yield message
        except CompletionError as error:
            failure = error
        except (asyncio.CancelledError, GeneratorExit):
            record.finish("CANCELLED")
            raise
        except Exception:
            logger.exception("unexpected error in %s (request %s)", METHOD, record.request_id)
            failure = InternalError("Internal error; the server log has the details.")
        if failure is None:
            record.finish("OK")
            if rest and request.stream:
                yield END_OF_EVENTS
            return
        record.finish(failure.grpc_code.name)
        if sent_any:
            # After the first message an error travels in-band, then ends the call.
            yield stream_error_chunk(failure)
            await context.abort(failure.grpc_code, failure.message, failure.metadata())
        await abort_before_output(context, failure, rest, identity)

    def check_size(
        self, message: CreateCompletionResponse, stream: bool, rest: RestCall | None
    ) -> None:
        size = message.ByteSize()
        if size > self._max_message_bytes:
            raise ReplyTooLargeError(size, self._max_message_bytes, "a gRPC message")
        if rest and not stream:
            rest.check_whole_reply(message)

    def record(self, request: CreateCompletionRequest, request_id: str) -> RequestRecord:
        prompts = None
        if self._log_prompts:
            prompts = [json_format.MessageToJson(request.prompt, indent=None)]
        return RequestRecord(
            request_id=request_id,
            method=METHOD,
            model=request.model,
            user=request.user,
            stream=request.stream,
            prompts=prompts,
        )

    def handler(self) -> CompletionHandler:
        handler = self._handler()
        if handler is None:
            raise EngineUnavailableError("The engine is not ready; retry shortly.")
        return handler


async def abort_before_output(
    context: grpc.aio.ServicerContext,
    error: CompletionError,
    rest: RestCall | None,
    extra: tuple[tuple[str, str], ...] = (),
) -> None:
    """End the call with the error's status, its details and, for REST, its HTTP form."""
    status = rpc_status.to_status(error.rpc_status())
    metadata = tuple(status.trailing_metadata) + error.metadata() + extra
    if rest:
        metadata += error_metadata(error)
    await context.abort(status.code, status.details, trailing_metadata=metadata)
