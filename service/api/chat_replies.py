"""vLLM's chat replies as ours: its whole reply, its stream events and its errors, turned into
CreateChatCompletionResponse messages and the API's errors."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import json_format
from llmcompletions.v2.completions_pb2 import CreateChatCompletionResponse

from service.api.caller_errors import vllm_error

EVENT_PREFIX = "data: "
DONE = "[DONE]"


@dataclass
class ChatReplies:
    """Turns vLLM's reply or events into ours, naming the model as the caller did and with
    this server's fingerprint; keeps the usage (the request's log line reports it)."""

    model: str
    system_fingerprint: str
    usage_asked: bool  # a stream's usage chunk goes to the caller only if it asked
    # When the caller asked for its timings: the call's arrival (time.monotonic()).
    timed_since: float | None = None
    usage: dict[str, Any] = field(default_factory=dict)

    def whole(self, reply: dict[str, Any]) -> CreateChatCompletionResponse:
        self.usage = reply.get("usage") or {}
        message = self.message(reply)
        return message if self.timed_since is None else self.with_timings(message)

    def events(self, text: str) -> Iterator[CreateChatCompletionResponse]:
        """The messages of one or more `data: ...` events; an error event raises."""
        for line in text.split("\n"):
            if not line.startswith(EVENT_PREFIX) or line == EVENT_PREFIX + DONE:
                continue
            event = json.loads(line[len(EVENT_PREFIX) :])
            if "error" in event:
                error = event["error"]
                raise vllm_error(
                    error.get("code", 500), error.get("message", ""), error.get("param")
                )
            if event.get("usage"):
                self.usage = event["usage"]
                if not event.get("choices"):  # the last event
                    if self.timed_since is not None:
                        yield self.with_timings(self.message(event))
                        continue
                    if not self.usage_asked:
                        continue
            yield self.message(event)

    def with_timings(self, message: CreateChatCompletionResponse) -> CreateChatCompletionResponse:
        """The reply, or a stream's last chunk, with the request's timings: vLLM's own (it
        times a request of one choice) and the whole time on this replica."""
        assert self.timed_since is not None
        message.metrics.total_time_ms = (time.monotonic() - self.timed_since) * 1000
        return message

    def message(self, reply: dict[str, Any]) -> CreateChatCompletionResponse:
        reply["model"] = self.model
        if "system_fingerprint" in reply or reply.get("object") == "chat.completion":
            reply["system_fingerprint"] = self.system_fingerprint
        if not self.usage_asked and reply.get("object") == "chat.completion.chunk":
            reply.pop("usage", None)
        if self.timed_since is None:
            reply.pop("metrics", None)  # vLLM times every request; the caller did not ask
        for choice in reply.get("choices", ()):
            for part in ("message", "delta"):
                said = choice.get(part)
                if said and said.get("reasoning") is not None:
                    said.setdefault("reasoning_content", said.pop("reasoning"))
        return json_format.ParseDict(
            reply, CreateChatCompletionResponse(), ignore_unknown_fields=True
        )

    def token_counts(self) -> tuple[int, int, int]:
        """Prompt, completion and cached prompt tokens, once the reply's usage is known."""
        details = self.usage.get("prompt_tokens_details") or {}
        return (
            self.usage.get("prompt_tokens", 0),
            self.usage.get("completion_tokens", 0),
            details.get("cached_tokens") or 0,
        )
