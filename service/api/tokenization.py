"""Tokenize and Detokenize: prompts counted exactly as CreateCompletion counts them (the same
parsing, limits and tokenizer calls), run off the event loop."""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor

from llmcompletions.v2.completions_pb2 import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)

from service.api.backlog import Backlog
from service.api.chat import ChatHandler
from service.api.chat_requests import conversation_of
from service.api.endpoint_models import check_served
from service.api.errors import FieldViolation, RequestValidationError
from service.api.prompts import prepare_prompts
from service.api.validation import (
    check_prompt_tokens,
    validate_detokenize_request,
    validate_tokenize_request,
)
from service.model.engine import ServedModel
from service.settings import RequestLimits


class Tokenization:
    def __init__(
        self,
        model: ServedModel,
        limits: RequestLimits,
        tokenizing: Executor,
        backlog: Backlog,
        chat: ChatHandler,
    ) -> None:
        self.model = model
        self.limits = limits
        self.tokenizing = tokenizing
        self.backlog = backlog  # a call waiting for the tokenizer counts as one sequence
        self.chat = chat  # renders a conversation as a chat request would

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        if request.messages:
            return await self.tokenize_conversation(request)
        prompts = validate_tokenize_request(request, self.model.vocab_size, self.limits)
        # 404 unless served; adapters share the tokenizer
        check_served(self.model.adapters, request.model)
        add_special_tokens = (
            request.add_special_tokens if request.HasField("add_special_tokens") else True
        )
        with self.backlog.preparing(1):
            prepared = await asyncio.get_running_loop().run_in_executor(
                self.tokenizing, prepare_prompts, prompts, self.model.tokenizer, add_special_tokens
            )
        check_prompt_tokens(prepared, self.limits.max_prompt_tokens)
        counts = [len(prompt.token_ids) for prompt in prepared]
        return TokenizeResponse(
            tokens=[token for prompt in prepared for token in prompt.token_ids],
            count=sum(counts),
            max_model_len=self.model.max_model_len,
            counts=counts if len(counts) > 1 else [],
        )

    async def tokenize_conversation(self, request: TokenizeRequest) -> TokenizeResponse:
        if request.HasField("prompt"):
            raise RequestValidationError(
                [FieldViolation(("prompt",), "give prompt or messages, not both", "value_error")]
            )
        with self.backlog.preparing(1):
            tokens = await self.chat.prompt_token_ids(conversation_of(request))
        return TokenizeResponse(
            tokens=tokens, count=len(tokens), max_model_len=self.model.max_model_len
        )

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        validate_detokenize_request(request, self.model.vocab_size, self.limits)
        # 404 unless served; adapters share the tokenizer
        check_served(self.model.adapters, request.model)
        with self.backlog.preparing(1):
            text = await asyncio.get_running_loop().run_in_executor(
                self.tokenizing, self.model.tokenizer.decode, list(request.tokens)
            )
        return DetokenizeResponse(prompt=text)
