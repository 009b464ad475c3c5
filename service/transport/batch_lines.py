"""A batch job's lines as calls of this server's own gRPC methods, over a unix socket only this
process listens on, so that each line takes the synchronous path whole: authentication as the
job's owner (its tenant's models and limits), validation, adapters, the engine, metrics and
the request log line. The call carries a token of this process's (no other process, nor any
caller, can present it) and the owner it runs for; it is marked as a REST call, so an error
comes back as the REST status and body the synchronous endpoint answers."""

from __future__ import annotations

import json
import secrets
from dataclasses import asdict
from typing import Any

import grpc
from google.protobuf import json_format
from llmcompletions.v2 import completions_pb2_grpc
from llmcompletions.v2.completions_pb2 import CreateChatCompletionRequest, CreateCompletionRequest

from service.api.batch.runner import Owner, RetryLaterError
from service.transport.rest_bridge import ERROR_BODY_HEADER, HTTP_STATUS_HEADER, TRANSCODED_MARKER

LINE_TOKEN_HEADER = "x-batch-line-token"
LINE_OWNER_HEADER = "x-batch-line-owner"
# This process's token: a line call presents it; nothing outside the process knows it.
LINE_TOKEN = secrets.token_urlsafe(32)
# Held back, not failed (the owner's rate limit, a full backlog: 429; the engine loading or
# draining: UNAVAILABLE): the line runs again after the server's retry-after (or this).
HELD_BACK_STATUS = 429
DEFAULT_RETRY_SECONDS = 1.0
LINE_TIMEOUT_SECONDS = 3600.0


def line_owner(metadata: tuple[tuple[str, str | bytes], ...]) -> Owner | None:
    """The owner a line call runs for, if it presents this process's token."""
    found = dict(metadata)
    token = found.get(LINE_TOKEN_HEADER)
    if not isinstance(token, str) or not secrets.compare_digest(token, LINE_TOKEN):
        return None
    return Owner(**json.loads(str(found.get(LINE_OWNER_HEADER, "{}"))))


class GrpcLineCaller:
    """Runs a line as a call of this server's own CreateCompletion or CreateChatCompletion."""

    def __init__(self, socket_path: str, priority: int | None) -> None:
        self.channel = grpc.aio.insecure_channel(f"unix:{socket_path}")
        self.stub = completions_pb2_grpc.CompletionServiceStub(self.channel)
        self.priority = priority  # the engine priority of batch lines, if it schedules by one

    async def __call__(self, kind: str, body: dict[str, Any], owner: Owner) -> dict[str, Any]:
        if self.priority is not None:
            body = {**body, "priority": self.priority}
        metadata = (
            (LINE_TOKEN_HEADER, LINE_TOKEN),
            (LINE_OWNER_HEADER, json.dumps(asdict(owner))),
            (TRANSCODED_MARKER, "/v2/batch-completions"),
        )
        if kind == "chat":
            request: Any = json_format.ParseDict(
                body, CreateChatCompletionRequest(), ignore_unknown_fields=True
            )
            call = self.stub.CreateChatCompletion(
                request, metadata=metadata, timeout=LINE_TIMEOUT_SECONDS
            )
        else:
            request = json_format.ParseDict(
                body, CreateCompletionRequest(), ignore_unknown_fields=True
            )
            call = self.stub.CreateCompletion(
                request, metadata=metadata, timeout=LINE_TIMEOUT_SECONDS
            )
        try:
            replies = [reply async for reply in call]
        except grpc.aio.AioRpcError as error:
            return await refusal(error)
        return {"response": rest_body(replies[-1])}

    async def close(self) -> None:
        await self.channel.close()


def rest_body(reply: Any) -> dict[str, Any]:
    """The reply as the REST endpoint prints it (the transcoder's print options)."""
    return json_format.MessageToDict(
        reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


async def refusal(error: grpc.aio.AioRpcError) -> dict[str, Any]:
    """The line's error as the REST endpoint answers it; RetryLaterError if held back."""
    trailers = dict(error.trailing_metadata() or ())
    status = trailers.get(HTTP_STATUS_HEADER)
    code = int(status) if isinstance(status, str) and status.isdigit() else 500
    if error.code() == grpc.StatusCode.UNAVAILABLE or code == HELD_BACK_STATUS:
        after = trailers.get("retry-after")
        seconds = float(after) if isinstance(after, str) and after.isdigit() else None
        raise RetryLaterError(seconds or DEFAULT_RETRY_SECONDS)
    body = trailers.get(ERROR_BODY_HEADER)
    detail: Any = error.details()
    if isinstance(body, str):
        detail = json.loads(body).get("detail", detail)
    return {"error": {"status_code": code, "detail": detail}}
