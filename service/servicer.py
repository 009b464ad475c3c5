"""The gRPC servicer: hands each request to the serving logic and yields what it makes.
Everything around a call (its id and record, authentication, admission, error statuses and
the REST framing) is done by the interceptor chain (`service.interception`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import grpc
from llmcompletions.v2 import completions_pb2_grpc
from llmcompletions.v2.completions_pb2 import CreateCompletionRequest, CreateCompletionResponse

from service.completions import CompletionHandler
from service.errors import EngineUnavailableError
from service.request_context import current_record


class CompletionServicer(completions_pb2_grpc.CompletionServiceServicer):
    def __init__(self, handler: Callable[[], CompletionHandler | None]) -> None:
        self._handler = handler  # None until the engine is ready

    async def CreateCompletion(
        self, request: CreateCompletionRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[CreateCompletionResponse]:
        async for message in self.handler().complete(request, current_record()):
            yield message

    def handler(self) -> CompletionHandler:
        handler = self._handler()
        if handler is None:
            raise EngineUnavailableError("The engine is not ready; retry shortly.")
        return handler
