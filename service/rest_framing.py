"""What the servicer tells Envoy's facade about framing a transcoded (REST) call.

The transcoder picks the gRPC method from the path alone, so one server-streaming method
serves both modes. The server, which parses `stream` exactly as the transcoder does, says
in initial metadata whether the REST reply is one JSON object or server-sent events, and
ends an event stream with an empty message that the facade rewrites to `data: [DONE]`.
"""

from __future__ import annotations

import grpc
from llmcompletions.v2.completions_pb2 import CreateCompletionResponse

# Envoy's transcoder sets this on every request it transcodes from REST.
TRANSCODED_MARKER = "x-envoy-original-path"
FRAMING_HEADER = "x-response-framing"
END_OF_EVENTS = CreateCompletionResponse()


def is_transcoded(context: grpc.aio.ServicerContext) -> bool:
    return any(key == TRANSCODED_MARKER for key, _ in context.invocation_metadata() or ())


def framing_metadata(stream: bool) -> tuple[tuple[str, str], ...]:
    return ((FRAMING_HEADER, "sse" if stream else "json"),)
