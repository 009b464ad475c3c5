"""A stream paced by its consumer, on the default stack over gRPC: a caller that keeps up gets
one message per token, as the engine makes them; one that falls behind gets what accumulated
meanwhile in fewer, larger messages (vLLM merges the deltas a stream has not taken yet, and the
server takes the next only once its last write is through), with the same text, tokens and
log-probabilities."""

from __future__ import annotations

import time
from typing import Any

import grpc
from llmcompletions.v2 import completions_pb2_grpc
from llmcompletions.v2.completions_pb2 import CreateCompletionResponse

from tests.conftest import GRPC_AUTH
from tests.helpers import grpc_request
from tests.processes import TestStack

TOKENS = 80
# A caller's receive window small enough that the server's writes wait for it to read: HTTP/2
# flow control with a 1 KiB window, not grown by gRPC's bandwidth probe.
SMALL_WINDOW = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
BEHIND_SECONDS = 2.5  # the slow caller reads one message, then nothing for this long
# A step of the engine's can outlast the server's write of the previous one on a busy host:
# then a caller keeping up gets two tokens in a message. It stays the exception.
KEPT_UP_SHARE = 0.9


def stream(stack: TestStack, options: list[tuple[str, Any]], pause: float) -> list[Any]:
    """The stream's messages with output, read by a caller that stops for `pause` seconds
    after the first."""
    request = grpc_request(
        prompt="Count:", max_tokens=TOKENS, ignore_eos=True, stream=True, logprobs=1
    )
    with grpc.insecure_channel(stack.grpc_target, options=options) as channel:
        stub = completions_pb2_grpc.CompletionServiceStub(channel)
        call = stub.CreateCompletion(request, timeout=120, metadata=GRPC_AUTH)
        messages: list[CreateCompletionResponse] = [next(call)]
        time.sleep(pause)
        messages += list(call)
    return [message.choices[0] for message in messages if message.choices]


def test_a_caller_that_falls_behind_gets_fewer_messages_with_the_same_tokens(
    stack: TestStack,
) -> None:
    keeping_up = stream(stack, SMALL_WINDOW, 0)
    behind = stream(stack, SMALL_WINDOW, BEHIND_SECONDS)
    singles = [len(choice.logprobs.tokens) == 1 for choice in keeping_up]
    assert sum(singles) >= KEPT_UP_SHARE * TOKENS, f"{sum(singles)} of {TOKENS} tokens alone"
    per_message = [len(choice.logprobs.tokens) for choice in behind]
    assert sum(per_message) == TOKENS
    # Seconds of the engine's tokens came in a few messages once the caller read again.
    assert len(behind) < len(keeping_up) - 5 and max(per_message) >= 5, per_message
    assert "".join(c.text for c in behind) == "".join(c.text for c in keeping_up)
    tokens = [list(c.logprobs.tokens) for c in keeping_up]
    assert [t for c in behind for t in c.logprobs.tokens] == [t for ts in tokens for t in ts]
