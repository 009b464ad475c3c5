"""The innermost interceptor: turns what the servicer yields and raises into what the call
sends. The first message goes out after the initial metadata (the request id and, for a REST
call, the framing); a REST event stream ends with the sentinel; every message is checked
against the size limits; an error becomes a status with its details (and, for REST, the HTTP
status and JSON body), or, after the first message, an in-band error message and then the
status. Refusals by other interceptors end through `abort_with` too. Every call that gets this
far ends with the replica's load report (service.transport.load_reports)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc
from google.protobuf.message import Message
from grpc_status import rpc_status

from service.api.errors import CompletionError, InternalError, ReplyTooLargeError
from service.api.responses import stream_error_chunk
from service.transport.interception import StreamBehaviour, StreamInterceptor
from service.transport.load_reports import LoadReports
from service.transport.request_context import REQUEST_ID_HEADER, current_record
from service.transport.rest_bridge import END_OF_EVENTS, RestCall, error_metadata, rest_call

logger = logging.getLogger(__name__)

Metadata = tuple[tuple[str, str | bytes], ...]


def identity() -> Metadata:
    return ((REQUEST_ID_HEADER, current_record().request_id),)


async def abort_with(
    context: grpc.aio.ServicerContext, error: CompletionError, extra: Metadata = ()
) -> None:
    """End a call that sent nothing yet with the error's status, its details (e.g.
    google.rpc.BadRequest), the request id, `extra` and, for REST, the HTTP status and JSON
    body."""
    status = rpc_status.to_status(error.rpc_status())
    metadata = tuple(status.trailing_metadata) + error.metadata() + identity() + extra
    if rest_call(context.invocation_metadata()) is not None:
        metadata += error_metadata(error)
    await context.abort(status.code, status.details, trailing_metadata=metadata)


def check_size(message: Message, max_message_bytes: int, whole_rest_reply: RestCall | None) -> None:
    size = message.ByteSize()
    if size > max_message_bytes:
        raise ReplyTooLargeError(size, max_message_bytes, "a gRPC message")
    if whole_rest_reply is not None:
        whole_rest_reply.check_whole_reply(message)


class ErrorMappingInterceptor(StreamInterceptor):
    def __init__(
        self, methods: frozenset[str], max_message_bytes: int, load_reports: LoadReports
    ) -> None:
        super().__init__(methods)
        self._max_message_bytes = max_message_bytes
        self._load_reports = load_reports

    async def around(
        self,
        inner: StreamBehaviour,
        method: str,
        request: Message,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[Message]:
        invocation = tuple(context.invocation_metadata() or ())
        rest = rest_call(invocation)
        stream = bool(getattr(request, "stream", False))
        # Only CreateCompletion (with its `stream` field) needs telling how to frame its reply.
        framed = rest is not None and hasattr(request, "stream")
        whole_rest_reply = rest if rest is not None and not stream else None
        sent_any = False
        try:
            async for message in inner(request, context):
                check_size(message, self._max_message_bytes, whole_rest_reply)
                if not sent_any:
                    framing = rest.framing(stream) if rest is not None and framed else ()
                    load = self._load_reports.header(invocation)
                    limits = current_record().reply_headers
                    await context.send_initial_metadata(identity() + framing + load + limits)
                    sent_any = True
                yield message
        except grpc.aio.AbortError:
            raise
        except CompletionError as error:
            failure = error
        except Exception:
            logger.exception(
                "unexpected error in %s (request %s)", method, current_record().request_id
            )
            failure = InternalError("Internal error; the server log has the details.")
        else:
            if rest is not None and stream:
                yield END_OF_EVENTS
            context.set_trailing_metadata(self._load_reports.trailer())
            return
        if sent_any:
            # After the first message an error travels in-band, then ends the call.
            yield stream_error_chunk(failure)
            metadata = failure.metadata() + self._load_reports.trailer()
            await context.abort(failure.grpc_code, failure.message, metadata)
        load = self._load_reports.header(invocation) + self._load_reports.trailer()
        await abort_with(context, failure, load)
