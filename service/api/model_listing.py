"""ListModels and GetModelInfo: the served names (the base model's and its adapters', from the
engine's catalog) described in the OpenAI model shape, plus what a caller needs to plan a
request."""

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

from service.api.endpoint_models import check_served
from service.api.tenants import visible
from service.model.engine import ServedModel

OWNED_BY = "llm-completions"


@dataclass(frozen=True)
class ModelListing:
    model: ServedModel
    created: int = field(default_factory=lambda: int(time.time()))

    def listing(self) -> ListModelsResponse:
        """The served names the caller's tenant may reach."""
        names = visible(self.model.adapters.names)
        return ListModelsResponse(object="list", data=[self.entry(name) for name in names])

    def entry(self, name: str) -> Model:
        return Model(**self.described(name))

    def info(self, name: str) -> GetModelInfoResponse:
        check_served(self.model.adapters, name)  # 404 unless served
        defaults = struct_pb2.Struct()
        defaults.update(self.model.default_sampling)
        return GetModelInfoResponse(
            **self.described(name),
            vocab_size=self.model.vocab_size,
            eos_token_ids=self.model.eos_token_ids,
            structured_outputs_backend=self.model.structured_outputs_backend,
            default_sampling=defaults,
            adapters=visible(self.model.adapters.names[1:]) if name == self.model.name else [],
        )

    def described(self, name: str) -> dict[str, Any]:
        """The fields a list entry and the model information share (the OpenAI shape)."""
        base = self.model.name
        parent = struct_pb2.Value()
        if name == base:
            parent.null_value = struct_pb2.NULL_VALUE
        else:
            parent.string_value = base
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": OWNED_BY,
            "parent": parent,
            "max_model_len": self.model.max_model_len,
        }
