"""The listing of every pool's models that the facade passes with a call, read from the
call's metadata (service.api.endpoint_models says what it is for)."""

from __future__ import annotations

import grpc
from google.protobuf.message import DecodeError
from llmcompletions.v2.completions_pb2 import ListModelsResponse

from plumbing.headers import ENDPOINT_MODELS_HEADER


def passed_listing(context: grpc.aio.ServicerContext) -> ListModelsResponse | None:
    for key, value in context.invocation_metadata() or ():
        if key == ENDPOINT_MODELS_HEADER and isinstance(value, bytes):
            try:
                return ListModelsResponse.FromString(value)
            except DecodeError:
                return None
    return None
