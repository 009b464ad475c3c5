"""What a job request may ask for: LLM Engine's fields, checked against what the running
engine is. Its nulls and the client's defaults are taken; a field that asks for what this
engine cannot give (another checkpoint, a longer context, another quantization, hardware, more
than one replica) is refused with 422 naming it, never silently ignored."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format
from llmcompletions.v2.completions_pb2 import CreateBatchCompletionRequest

from service.api.validation import Violations

DEFAULT_MAX_RUNTIME_SEC = 86_400
MAX_RUNTIME_SEC = 172_800
# A job's lines split into at most this many shards, each run by one process at a time.
MAX_DATA_PARALLELISM = 64
# LLM Engine's model_config fields that need no engine change: the model (checked as served),
# a shard count (a suggestion, as LLM Engine documents it), labels, a seed (a line's own wins).
FREE_FIELDS = frozenset({"model", "num_shards", "labels", "seed"})
HARDWARE_FIELDS = ("tool_config", "cpus", "gpus", "memory", "gpu_type", "storage")


@dataclass(frozen=True)
class EngineFacts:
    """What the running engine is, as a job request is checked against it."""

    max_model_len: int
    quantization: str | None


def model_config_of(request: CreateBatchCompletionRequest) -> dict[str, Any]:
    return json_format.MessageToDict(request.model_config)


def check_job_request(
    request: CreateBatchCompletionRequest, engine: EngineFacts, found: Violations
) -> None:
    config = model_config_of(request)
    if not isinstance(config.get("model"), str) or not config["model"]:
        found.add(("model_config", "model"), "model_config.model is required", "missing")
    for name, value in config.items():
        if name not in FREE_FIELDS and value not in (None, False):
            check_engine_field(name, value, engine, found)
    for name in HARDWARE_FIELDS:
        if request.HasField(name) and request_value(request, name) is not None:
            found.add(
                (name,),
                f"{name} must be null: the job runs on this replica's engine as it is",
            )
    if request.HasField("nodes_per_worker") and request_value(request, "nodes_per_worker"):
        found.add(("nodes_per_worker",), "nodes_per_worker must be null or 1")
    if not 1 <= data_parallelism(request) <= MAX_DATA_PARALLELISM:
        found.add(
            ("data_parallelism",),
            f"data_parallelism must be 1 to {MAX_DATA_PARALLELISM}: how many replicas (or "
            "frontend processes) may run the job's lines at once",
        )
    runtime = max_runtime_sec(request)
    if not 1 <= runtime <= MAX_RUNTIME_SEC:
        found.add(("max_runtime_sec",), f"max_runtime_sec must be 1 to {MAX_RUNTIME_SEC}")


def check_engine_field(name: str, value: Any, engine: EngineFacts, found: Violations) -> None:
    loc = ("model_config", name)
    if name == "max_context_length":
        if isinstance(value, (int, float)) and value <= engine.max_model_len:
            return
        found.add(loc, f"max_context_length may be at most the engine's {engine.max_model_len}")
    elif name in ("quantize", "quantization"):
        if value == engine.quantization:
            return
        found.add(loc, f"{name} must be null or the engine's ({engine.quantization}): {value!r}")
    elif name == "response_role" and value == "assistant":
        return
    else:
        found.add(
            loc,
            f"model_config.{name} must be null: the job runs on the engine as it is, which "
            "cannot change per job",
        )


def request_value(request: CreateBatchCompletionRequest, name: str) -> Any:
    return json_format.MessageToDict(getattr(request, name))


def max_runtime_sec(request: CreateBatchCompletionRequest) -> int:
    if request.HasField("max_runtime_sec"):
        return request.max_runtime_sec
    return DEFAULT_MAX_RUNTIME_SEC


def data_parallelism(request: CreateBatchCompletionRequest) -> int:
    return request.data_parallelism if request.HasField("data_parallelism") else 1


def requests_of(content: Any) -> list[Any] | None:
    """The request list `content` holds, or None if it holds none."""
    return list(content) if isinstance(content, list) else None
