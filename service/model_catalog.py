"""What this endpoint serves: the names a caller may pass as `model`, and their descriptions
for ListModels and GetModelInfo (the OpenAI model shape, plus what a caller needs to plan a
request)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import struct_pb2
from llmcompletions.v2.completions_pb2 import (
    GetModelInfoResponse,
    ListModelsResponse,
    Model,
)

from service.engine import ServedModel
from service.errors import ModelNotFoundError

OWNED_BY = "llm-completions"
NO_PARENT = struct_pb2.Value(null_value=struct_pb2.NULL_VALUE)  # a base model


@dataclass(frozen=True)
class ModelCatalog:
    model: ServedModel
    created: int = field(default_factory=lambda: int(time.time()))

    def names(self) -> list[str]:
        return [self.model.name]

    def check_served(self, name: str) -> None:
        """Raise ModelNotFoundError (404) unless `name` is served here."""
        if name not in self.names():
            raise ModelNotFoundError(name, self.names())

    def listing(self) -> ListModelsResponse:
        return ListModelsResponse(object="list", data=[self.entry(name) for name in self.names()])

    def entry(self, name: str) -> Model:
        return Model(**self.described(name))

    def info(self, name: str) -> GetModelInfoResponse:
        self.check_served(name)
        defaults = struct_pb2.Struct()
        defaults.update(self.model.default_sampling)
        return GetModelInfoResponse(
            **self.described(name),
            vocab_size=self.model.vocab_size,
            eos_token_ids=self.model.eos_token_ids,
            structured_outputs_backend=self.model.structured_outputs_backend,
            default_sampling=defaults,
        )

    def described(self, name: str) -> dict[str, Any]:
        """The fields a list entry and the model information share (the OpenAI shape)."""
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": OWNED_BY,
            "parent": NO_PARENT,
            "max_model_len": self.model.max_model_len,
        }
