"""A small typed client for CompletionService, synchronous and asynchronous.

    from llmcompletions.client import CompletionClient

    with CompletionClient("127.0.0.1:50051") as client:
        print(client.complete(model="smollm2-135m-instruct", prompt="Hello").choices[0].text)
        for chunk in client.stream(model="smollm2-135m-instruct", prompt="Hello"):
            print(chunk.choices[0].text, end="")

Fields are the request's JSON fields as keyword arguments (`prompt` may be a string, a list
of strings, a list of token ids or a list of token-id lists); a ready-made
CreateCompletionRequest may be passed instead. Chat works the same way:

        reply = client.chat(model="smollm2-135m-instruct",
                            messages=[{"role": "user", "content": "Hello"}])
        print(reply.choices[0].message.content)
        for chunk in client.chat_stream(model="smollm2-135m-instruct", messages=[...]):
            print(chunk.choices[0].delta.content if chunk.choices else "", end="")

A completion sent with an `x-request-id` of the caller's choosing can be stopped from anywhere
(another thread, process or Envoy of the fleet) by that id, with the same API key:

        client.cancel("my-request-1")  # its call ends with grpc.StatusCode.CANCELLED

Over TLS, pass `tls=Tls(ca_file=...)` (and `cert_file`, `key_file` for mutual TLS):

    with CompletionClient("llm.internal:50051", tls=Tls("ca.crt", "me.crt", "me.key")) as c:
        ...
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import grpc
from google.protobuf import json_format

from llmcompletions.json_order import ordered_bytes
from llmcompletions.v2 import completions_pb2, completions_pb2_grpc
from llmcompletions.v2.completions_pb2 import (
    CancelCompletionRequest,
    CancelCompletionResponse,
    CreateChatCompletionRequest,
    CreateChatCompletionResponse,
    CreateCompletionRequest,
    CreateCompletionResponse,
)

Metadata = Sequence[tuple[str, str]]
SERVICE = completions_pb2.DESCRIPTOR.services_by_name["CompletionService"]
DEFAULT_TIMEOUT_SECONDS = 300.0
# gRPC clients accept 4 MiB messages by default; a whole reply may be as large as the server
# sends (its --max-message-bytes, 16 MiB by default).
MAX_REPLY_BYTES = 16 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_REPLY_BYTES),
    # A ping after 30 s of silence, answered within 20 s, or the call fails UNAVAILABLE: a
    # server or route that vanished without closing does not hang a call forever. The server
    # accepts pings as often as every 5 s, with or without calls.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.http2.ping_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # Calls in turn over every address the target names: a replica's frontends given as
    # "ipv4:HOST:PORT,HOST:PORT" (or a name that resolves to several) each get their share. One
    # address works as before; a connection stays on the frontend it reached.
    ("grpc.lb_policy_name", "round_robin"),
]


@dataclass(frozen=True)
class Tls:
    """TLS to the server: the CA certificates to trust (None: the system's), and the client
    certificate and key to present when the server requires one (mutual TLS). PEM files."""

    ca_file: str | Path | None = None
    cert_file: str | Path | None = None
    key_file: str | Path | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together")

        def read(path: str | Path | None) -> bytes | None:
            return None if path is None else Path(path).read_bytes()

        return grpc.ssl_channel_credentials(
            read(self.ca_file), read(self.key_file), read(self.cert_file)
        )


Request = TypeVar("Request", CreateCompletionRequest, CreateChatCompletionRequest)


def build_request(
    request: CreateCompletionRequest | None = None, stream: bool = False, **fields: Any
) -> CreateCompletionRequest:
    return built(CreateCompletionRequest(), request, stream, fields)


def build_chat_request(
    request: CreateChatCompletionRequest | None = None, stream: bool = False, **fields: Any
) -> CreateChatCompletionRequest:
    return built(CreateChatCompletionRequest(), request, stream, fields)


def built(empty: Request, given: Request | None, stream: bool, fields: dict[str, Any]) -> Request:
    if given is not None:
        empty.CopyFrom(given)
    json_format.ParseDict(fields, empty)
    empty.stream = stream
    return empty


def request_bytes(
    message_type: type[Request], given: Request | None, stream: bool, fields: dict[str, Any]
) -> bytes:
    """What `built` serializes to. From fields alone, the JSON objects among them (a schema,
    a tool's parameters) keep their keys' order (llmcompletions.json_order), which the
    server's output follows; a ready-made request is sent as protobuf serializes it."""
    if given is not None:
        return built(message_type(), given, stream, fields).SerializeToString()
    return ordered_bytes(message_type, {**fields, "stream": stream})


def streaming(channel: Any, method: str) -> Any:
    """The server-streaming `method` on `channel` (sync or asyncio), its request sent as the
    bytes it is given (request_bytes), its replies parsed as the stub parses them."""
    reply = getattr(completions_pb2, SERVICE.methods_by_name[method].output_type.name)
    return channel.unary_stream(
        f"/{SERVICE.full_name}/{method}",
        request_serializer=None,
        response_deserializer=reply.FromString,
    )


def call_metadata(api_key: str | None, metadata: Metadata) -> list[tuple[str, str]]:
    headers = list(metadata)
    if api_key is not None:
        headers.append(("authorization", f"Bearer {api_key}"))
    return headers


class CompletionClient:
    """Blocking client. Errors raise grpc.RpcError with the server's status and details."""

    def __init__(
        self,
        target: str,
        *,
        api_key: str | None = None,
        timeout: float | None = DEFAULT_TIMEOUT_SECONDS,
        channel: grpc.Channel | None = None,
        tls: Tls | None = None,
    ) -> None:
        if channel is None and tls is not None:
            channel = grpc.secure_channel(target, tls.credentials(), options=CHANNEL_OPTIONS)
        self._channel = channel or grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._stub = completions_pb2_grpc.CompletionServiceStub(self._channel)
        self._create_completion = streaming(self._channel, "CreateCompletion")
        self._create_chat_completion = streaming(self._channel, "CreateChatCompletion")
        self._api_key = api_key
        self._timeout = timeout

    def complete(
        self,
        request: CreateCompletionRequest | None = None,
        *,
        timeout: float | None = None,
        metadata: Metadata = (),
        **fields: Any,
    ) -> CreateCompletionResponse:
        """The whole completion (`stream` false): exactly one message."""
        (response,) = self._create_completion(
            request_bytes(CreateCompletionRequest, request, False, fields),
            timeout=timeout or self._timeout,
            metadata=call_metadata(self._api_key, metadata),
        )
        return response

    def stream(
        self,
        request: CreateCompletionRequest | None = None,
        *,
        timeout: float | None = None,
        metadata: Metadata = (),
        **fields: Any,
    ) -> Iterator[CreateCompletionResponse]:
        """Text deltas as they are generated (`stream` true)."""
        yield from self._create_completion(
            request_bytes(CreateCompletionRequest, request, True, fields),
            timeout=timeout or self._timeout,
            metadata=call_metadata(self._api_key, metadata),
        )

    def chat(
        self,
        request: CreateChatCompletionRequest | None = None,
        *,
        timeout: float | None = None,
        metadata: Metadata = (),
        **fields: Any,
    ) -> CreateChatCompletionResponse:
        """The whole chat reply (`stream` false): exactly one message."""
        (response,) = self._create_chat_completion(
            request_bytes(CreateChatCompletionRequest, request, False, fields),
            timeout=timeout or self._timeout,
            metadata=call_metadata(self._api_key, metadata),
        )
        return response

    def chat_stream(
        self,
        request: CreateChatCompletionRequest | None = None,
        *,
        timeout: float | None = None,
        metadata: Metadata = (),
        **fields: Any,
    ) -> Iterator[CreateChatCompletionResponse]:
        """The reply's chunks as they are generated (`stream` true): the role first, then
        content and tool-call deltas, each choice's last with its finish_reason."""
        yield from self._create_chat_completion(
            request_bytes(CreateChatCompletionRequest, request, True, fields),
            timeout=timeout or self._timeout,
            metadata=call_metadata(self._api_key, metadata),
        )

    def cancel(
        self,
        request_id: str,
        *,
        model: str = "",
        timeout: float | None = None,
        metadata: Metadata = (),
    ) -> CancelCompletionResponse:
        """Stops this caller's completions and chats sent with `request_id` as their
        x-request-id (`model` takes the cancel to its pool behind a multi-pool endpoint);
        NOT_FOUND if none is running or queued."""
        return self._stub.CancelCompletion(
            CancelCompletionRequest(request_id=request_id, model=model),
            timeout=timeout or self._timeout,
            metadata=call_metadata(self._api_key, metadata),
        )

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> CompletionClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


class AsyncCompletionClient:
    """asyncio client (grpc.aio). Errors raise grpc.aio.AioRpcError."""

    def __init__(
        self,
        target: str,
        *,
        api_key: str | None = None,
        timeout: float | None = DEFAULT_TIMEOUT_SECONDS,
        channel: grpc.aio.Channel | None = None,
        tls: Tls | None = None,
    ) -> None:
        if channel is None and tls is not None:
            channel = grpc.aio.secure_channel(target, tls.credentials(), options=CHANNEL_OPTIONS)
        self._channel = channel or grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._stub = completions_pb2_grpc.CompletionServiceStub(self._channel)
        self._create_completion = streaming(self._channel, "CreateCompletion")
        self._create_chat_completion = streaming(self._channel, "CreateChatCompletion")
        self._api_key = api_key
        self._timeout = timeout

    async def complete(
        self,
        request: CreateCompletionRequest | None = None,
        *,
        timeout: float | None = None,
        metadata: Metadata = (),
        **fields: Any,
    ) -> CreateCompletionResponse:
        messages = [
            message
            async for message in self.stream_messages(
                request_bytes(CreateCompletionRequest, request, False, fields), timeout, metadata
            )
        ]
        (response,) = messages
        return response

    async def stream(
        self,
        request: CreateCompletionRequest | None = None,
        *,
        timeout: float | None = None,
        metadata: Metadata = (),
        **fields: Any,
    ) -> AsyncIterator[CreateCompletionResponse]:
        async for message in self.stream_messages(
            request_bytes(CreateCompletionRequest, request, True, fields), timeout, metadata
        ):
            yield message

    def stream_messages(
        self, request: bytes, timeout: float | None, metadata: Metadata
    ) -> AsyncIterator[CreateCompletionResponse]:
        return self._create_completion(
            request,
            timeout=timeout or self._timeout,
            metadata=call_metadata(self._api_key, metadata),
        )

    async def chat(
        self,
        request: CreateChatCompletionRequest | None = None,
        *,
        timeout: float | None = None,
        metadata: Metadata = (),
        **fields: Any,
    ) -> CreateChatCompletionResponse:
        (response,) = [
            message
            async for message in self._create_chat_completion(
                request_bytes(CreateChatCompletionRequest, request, False, fields),
                timeout=timeout or self._timeout,
                metadata=call_metadata(self._api_key, metadata),
            )
        ]
        return response

    async def chat_stream(
        self,
        request: CreateChatCompletionRequest | None = None,
        *,
        timeout: float | None = None,
        metadata: Metadata = (),
        **fields: Any,
    ) -> AsyncIterator[CreateChatCompletionResponse]:
        async for message in self._create_chat_completion(
            request_bytes(CreateChatCompletionRequest, request, True, fields),
            timeout=timeout or self._timeout,
            metadata=call_metadata(self._api_key, metadata),
        ):
            yield message

    async def cancel(
        self,
        request_id: str,
        *,
        model: str = "",
        timeout: float | None = None,
        metadata: Metadata = (),
    ) -> CancelCompletionResponse:
        """As CompletionClient.cancel."""
        return await self._stub.CancelCompletion(
            CancelCompletionRequest(request_id=request_id, model=model),
            timeout=timeout or self._timeout,
            metadata=call_metadata(self._api_key, metadata),
        )

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncCompletionClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()
