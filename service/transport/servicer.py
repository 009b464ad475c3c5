"""The gRPC servicer: hands each request to the serving logic and returns what it makes.
Everything around a call (its id and record, authentication, error statuses and
the REST framing) is done by the interceptor chain (`service.transport.interception`)."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TypeVar, cast

import grpc
from google.protobuf.message import Message
from llmcompletions.v2 import completions_pb2_grpc
from llmcompletions.v2.completions_pb2 import (
    CancelCompletionRequest,
    CancelCompletionResponse,
    CreateChatCompletionRequest,
    CreateChatCompletionResponse,
    CreateCompletionRequest,
    CreateCompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    GetModelInfoRequest,
    GetModelInfoResponse,
    ListModelsRequest,
    ListModelsResponse,
    LoadLoraAdapterRequest,
    LoadLoraAdapterResponse,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoraAdapterRequest,
    UnloadLoraAdapterResponse,
)

from plumbing.headers import ATTEMPT_COUNT_HEADER, FANOUT_CONTINUE, FANOUT_HEADER
from service.api import endpoint_models
from service.api.adapter_admin import AdapterAdmin, AdapterReply
from service.api.cancellation import CancellableCall, Cancellations
from service.api.chat import ChatHandler
from service.api.completions import CompletionHandler
from service.api.errors import (
    CancelForbiddenError,
    CancelTargetNotFoundError,
    CompletionError,
    EngineUnavailableError,
)
from service.api.model_listing import ModelListing
from service.api.tokenization import Tokenization
from service.transport.observability import RequestRecord
from service.transport.request_context import current_record
from service.transport.siblings import Siblings, is_forwarded

# How long a sibling frontend may take to load an adapter (read, copy, check, load).
LOAD_SECONDS = 120.0


class FanOuts:
    """The adapter calls done here (whoever asked, a sibling included) and those Envoy's
    fan-out brought here, by request id and method; the latest few thousand."""

    def __init__(self, size: int = 4096) -> None:
        self.done: BoundedDict = BoundedDict(size)
        self.asked: BoundedDict = BoundedDict(size)


class BoundedDict(OrderedDict[tuple[str, str], AdapterReply]):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def __setitem__(self, key: tuple[str, str], value: AdapterReply) -> None:
        super().__setitem__(key, value)
        while len(self) > self.size:
            self.popitem(last=False)


Reply = TypeVar("Reply", LoadLoraAdapterResponse, UnloadLoraAdapterResponse)


def counted(reply: Reply, replicas: int) -> Reply:
    """A copy of `reply` that says `replicas` did it."""
    copy = type(reply)()
    copy.CopyFrom(reply)
    copy.replicas = replicas
    return copy


def header(metadata: tuple[tuple[str, str | bytes], ...], name: str) -> str | None:
    return next((str(value) for key, value in metadata if key == name), None)


class SiblingRefusedError(CompletionError):
    """Another frontend of this replica refused a call this one did."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self.grpc_code = code
        super().__init__(f"another frontend of this replica refused it: {details}")


@dataclass(frozen=True)
class Serving:
    """The serving logic of a loaded engine, one part per kind of call."""

    completions: CompletionHandler
    chat: ChatHandler
    models: ModelListing
    tokenization: Tokenization
    cancellations: Cancellations
    adapters: AdapterAdmin


class CompletionServicer(completions_pb2_grpc.CompletionServiceServicer):
    def __init__(
        self, serving: Callable[[], Serving | None], siblings: Siblings | None = None
    ) -> None:
        self._serving = serving  # None until the engine is ready
        self.siblings = siblings  # the replica's other frontends, if it has several
        self.fanouts = FanOuts()

    # Each call's messages pass through one generator here: one layer less per token.
    async def CreateCompletion(
        self, request: CreateCompletionRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[CreateCompletionResponse]:
        serving, record = self.serving(), current_record()
        with self.cancellable(serving, record) as call:
            async for message in serving.completions.complete(request, record, call):
                yield message

    async def CreateChatCompletion(
        self, request: CreateChatCompletionRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[CreateChatCompletionResponse]:
        serving, record = self.serving(), current_record()
        with self.cancellable(serving, record) as call:
            async for message in serving.chat.complete(request, record, call):
                yield message

    @staticmethod
    def cancellable(
        serving: Serving, record: RequestRecord
    ) -> AbstractContextManager[CancellableCall]:
        """The call, cancellable by its id while it runs."""
        return serving.cancellations.track(record.request_id, record.principal)

    async def CancelCompletion(
        self, request: CancelCompletionRequest, context: grpc.aio.ServicerContext
    ) -> CancelCompletionResponse:
        try:
            cancelled = await self.serving().cancellations.cancel(
                request.request_id, current_record().principal
            )
        except (CancelTargetNotFoundError, CancelForbiddenError) as here:
            metadata = tuple(context.invocation_metadata() or ())
            if self.siblings is None or is_forwarded(metadata):
                raise
            cancelled = await self.cancel_in_siblings(request, metadata, here)
        return CancelCompletionResponse(
            request_id=request.request_id, object="completion.cancelled", cancelled=cancelled
        )

    async def cancel_in_siblings(
        self,
        request: CancelCompletionRequest,
        metadata: tuple[tuple[str, str | bytes], ...],
        here: CancelTargetNotFoundError | CancelForbiddenError,
    ) -> int:
        """The calls the other frontends cancelled; else the most telling refusal."""
        assert self.siblings is not None
        done, codes = await self.siblings.cancel(request, metadata)
        if done:
            return sum(reply.cancelled for reply in done)
        if grpc.StatusCode.PERMISSION_DENIED in codes:
            raise CancelForbiddenError(request.request_id)
        raise here

    async def ListModels(
        self, request: ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> ListModelsResponse:
        # Behind a facade with several pools, every pool's models (the facade passes them).
        endpoint = endpoint_models.endpoint_listing()
        if endpoint is not None:
            return endpoint_models.visible_listing(endpoint)
        return self.serving().models.listing()

    async def GetModelInfo(
        self, request: GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> GetModelInfoResponse:
        return self.serving().models.info(request.model)

    async def Tokenize(
        self, request: TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> TokenizeResponse:
        return await self.serving().tokenization.tokenize(request)

    async def Detokenize(
        self, request: DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> DetokenizeResponse:
        return await self.serving().tokenization.detokenize(request)

    async def LoadLoraAdapter(
        self, request: LoadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> LoadLoraAdapterResponse:
        return await self.adapter_call(
            "LoadLoraAdapter", request, context, lambda admin: admin.load(request), 0.0
        )

    async def UnloadLoraAdapter(
        self, request: UnloadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> UnloadLoraAdapterResponse:
        return await self.adapter_call(
            "UnloadLoraAdapter",
            request,
            context,
            lambda admin: admin.unload(request),
            self.serving().adapters.drain_seconds,
        )

    async def adapter_call(
        self,
        method: str,
        request: Message,
        context: grpc.aio.ServicerContext,
        act: Callable[[AdapterAdmin], Awaitable[Reply]],
        drain_seconds: float,
    ) -> Reply:
        """A load or unload here, then in the sibling frontends; through Envoy's fan-out
        (FANOUT_HEADER), the reply counts the replicas tried so far and asks for the next."""
        metadata = tuple(context.invocation_metadata() or ())
        call_id = (current_record().request_id, method)
        fanout = header(metadata, FANOUT_HEADER) is not None
        attempt = int(header(metadata, ATTEMPT_COUNT_HEADER) or 1)
        if fanout and call_id in self.fanouts.asked:  # Envoy came back: all were tried
            return counted(cast(Reply, self.fanouts.asked[call_id]), self.replicas(attempt - 1))
        reply = cast(Reply | None, self.fanouts.done.get(call_id)) if fanout else None
        if reply is None:  # not done yet here (a sibling may have done it for this replica)
            reply = await act(self.serving().adapters)
            self.fanouts.done[call_id] = reply
            await self.in_siblings(method, request, context, LOAD_SECONDS + drain_seconds)
        if not fanout:
            return reply
        self.fanouts.asked[call_id] = reply
        current_record().reply_headers += ((FANOUT_HEADER, FANOUT_CONTINUE),)
        return counted(reply, self.replicas(attempt))

    def replicas(self, endpoints: int) -> int:
        """The replicas that `endpoints` of Envoy's fan-out make: with several frontends, Envoy
        knows each frontend's port (as the launcher and the manifests set it up), so a replica
        is as many endpoints as it has frontends (its pool's replicas alike)."""
        frontends = 1 if self.siblings is None else len(self.siblings.channels) + 1
        return math.ceil(endpoints / frontends)

    async def in_siblings(
        self, method: str, request: Message, context: grpc.aio.ServicerContext, timeout: float
    ) -> None:
        """The same call on the replica's other frontends (each holds its own adapter table);
        the first refusal, if one refused."""
        metadata = tuple(context.invocation_metadata() or ())
        if self.siblings is None or is_forwarded(metadata):
            return
        refused = await self.siblings.each(method, request, metadata, timeout)
        if refused:
            raise SiblingRefusedError(refused[0].code(), refused[0].details() or "")

    def serving(self) -> Serving:
        serving = self._serving()
        if serving is None:
            raise EngineUnavailableError("The engine is not ready; retry shortly.")
        return serving
