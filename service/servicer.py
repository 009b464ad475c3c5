"""The gRPC servicer: hands requests to the completion handler and maps errors to statuses."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable

import grpc
from grpc_status import rpc_status
from llmcompletions.v2 import completions_pb2_grpc
from llmcompletions.v2.completions_pb2 import CompletionRequest, CompletionResponse

from service.completions import CompletionHandler
from service.errors import (
    CompletionError,
    EngineUnavailableError,
    InternalError,
    rest_error_metadata,
)
from service.responses import stream_error_chunk
from service.rest_framing import END_OF_EVENTS, framing_metadata, is_transcoded

logger = logging.getLogger(__name__)


class CompletionServicer(completions_pb2_grpc.CompletionServiceServicer):
    def __init__(self, handler: Callable[[], CompletionHandler | None]) -> None:
        self._handler = handler  # None until the engine is ready

    async def CreateCompletion(
        self, request: CompletionRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[CompletionResponse]:
        transcoded = is_transcoded(context)
        sent_any = False
        failure: CompletionError | None = None
        try:
            async for message in self.handler().complete(request):
                if not sent_any and transcoded:
                    await context.send_initial_metadata(framing_metadata(request.stream))
                sent_any = True
                yield message
        except CompletionError as error:
            failure = error
        except Exception:
            logger.exception("unexpected error in CreateCompletion")
            failure = InternalError("Internal error; the server log has the details.")
        if failure is None:
            if transcoded and request.stream:
                yield END_OF_EVENTS
            return
        if sent_any:
            # After the first message an error travels in-band, then ends the call.
            yield stream_error_chunk(failure)
            await context.abort(failure.grpc_code, failure.message)
        await abort_before_output(context, failure, transcoded)

    def handler(self) -> CompletionHandler:
        handler = self._handler()
        if handler is None:
            raise EngineUnavailableError("The engine is still loading; retry shortly.")
        return handler


async def abort_before_output(
    context: grpc.aio.ServicerContext, error: CompletionError, transcoded: bool
) -> None:
    """End the call with the error's status, its details and, for REST, its HTTP form."""
    status = rpc_status.to_status(error.rpc_status())
    metadata = tuple(status.trailing_metadata)
    if transcoded:
        metadata += rest_error_metadata(error)
    await context.abort(status.code, status.details, trailing_metadata=metadata)
