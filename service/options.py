"""The `serve` command's options, in groups (engine, LoRA, limits, transport), each with the
environment variable that sets it and the default from the settings objects; and the
converters that refuse a bad value with a usage error naming the option."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from plumbing.options import (
    add_option,
    add_removed_option,
    add_switch,
    non_negative_int,
    one_of,
    positive_float,
    positive_int,
)
from plumbing.tls import tls_settings
from plumbing.tracing import add_tracing_option, tracing_settings
from service.api.declared_ranges import ENGINE_MAX_LOGPROBS
from service.model.capacity import QUEUED_BATCHES, QUEUED_PREFILL_STEPS
from service.model.default_model import DEFAULT_SERVED_MODEL_NAME
from service.model.placement import PlacementError, available_cores, parse_core_list
from service.settings import (
    DEFAULT_IMAGES_PER_PROMPT,
    BatchSettings,
    ChatSettings,
    EngineSettings,
    KeepaliveSettings,
    LoraModule,
    MediaSettings,
    RequestLimits,
    ServerSettings,
    default_batch_root,
)

# The service's name in traces, unless OTEL_SERVICE_NAME names it.
DEFAULT_TRACING_NAME = "llm-completions"


def json_object(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, e.g. '{\"max_num_seqs\": 64}'")
    return value


def lora_modules(text: str) -> tuple[LoraModule, ...]:
    """`NAME=PATH`, or several separated by commas (as the environment variable holds them)."""
    modules = []
    for item in text.split(","):
        name, equals, path = item.strip().partition("=")
        if not (equals and name.strip() and path.strip()):
            raise argparse.ArgumentTypeError(
                f"{item.strip()!r} is not NAME=PATH, e.g. sql-expert=/adapters/sql"
            )
        modules.append(LoraModule(name.strip(), Path(path.strip()).expanduser()))
    return tuple(modules)


lora_modules.__name__ = "NAME=PATH"  # argparse: "invalid NAME=PATH value"


def module_names(text: str) -> tuple[str, ...]:
    """Module names separated by commas, e.g. `q_proj,v_proj`."""
    names = tuple(name.strip() for name in text.split(","))
    if not all(name.isidentifier() for name in names):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a list of module names, e.g. q_proj,v_proj"
        )
    return names


module_names.__name__ = "module list"  # argparse: "invalid module list value"


class Flatten(argparse.Action):
    """Several values, each a tuple of items (nargs="+"), as one tuple."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, tuple(item for value in values or () for item in value))


def engine_defaults() -> dict[str, Any]:
    """EngineSettings' defaults (it has no default model), the one source of the CLI's."""
    return {field.name: field.default for field in dataclasses.fields(EngineSettings)}


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    defaults = engine_defaults()
    add_option(
        parser,
        "--model",
        "MODEL",
        None,
        "Hugging Face model directory; unset serves the embedded SmolLM2-135M-Instruct",
        Path,
    )
    add_option(
        parser,
        "--served-model-name",
        "SERVED_MODEL_NAME",
        None,
        f"name callers pass as `model` (unset: {DEFAULT_SERVED_MODEL_NAME} for the "
        "default model, else the model directory's name)",
    )
    add_option(
        parser, "--dtype", "DTYPE", defaults["dtype"], "weights dtype; auto is float32 on a CPU"
    )
    add_option(
        parser,
        "--max-model-len",
        "MAX_MODEL_LEN",
        None,
        "context length (prompt + completion tokens); unset: the model's",
        int,
    )
    add_option(
        parser,
        "--kv-cache-gib",
        "KV_CACHE_GIB",
        None,
        "memory for the KV cache in GiB; unset: 2 on a CPU, vLLM's default on a GPU",
        float,
    )
    add_option(
        parser,
        "--structured-outputs-backend",
        "STRUCTURED_OUTPUTS_BACKEND",
        defaults["structured_outputs_backend"],
        "backend for guided_* and response_format (xgrammar, guidance, outlines, "
        "lm-format-enforcer); requests may name only this one",
    )
    add_option(
        parser,
        "--scheduling-policy",
        "SCHEDULING_POLICY",
        defaults["scheduling_policy"],
        "the order waiting requests run in: fcfs (arrival) or priority (a request's "
        "`priority`, lower first; with fcfs a non-zero priority is refused)",
        one_of("fcfs", "priority"),
    )
    add_option(
        parser,
        "--tensor-parallel-size",
        "TENSOR_PARALLEL_SIZE",
        defaults["tensor_parallel_size"],
        "devices one model is sharded over (vLLM tensor parallelism)",
        positive_int,
    )
    add_option(
        parser,
        "--pipeline-parallel-size",
        "PIPELINE_PARALLEL_SIZE",
        defaults["pipeline_parallel_size"],
        "pipeline stages the layers are split into (across GPUs or nodes)",
        positive_int,
    )
    add_option(
        parser,
        "--data-parallel-size",
        "DATA_PARALLEL_SIZE",
        defaults["data_parallel_size"],
        "engine replicas inside this server (vLLM data parallelism)",
        positive_int,
    )
    add_option(
        parser,
        "--distributed-executor-backend",
        "DISTRIBUTED_EXECUTOR_BACKEND",
        None,
        "mp (one node) or ray (several nodes); unset: vLLM chooses",
    )
    add_capacity_options(parser)
    add_placement_options(parser)
    add_lora_options(parser, defaults)
    add_option(
        parser,
        "--engine-args",
        "ENGINE_ARGS",
        {},
        "other vLLM engine arguments as a JSON object",
        json_object,
    )


def add_capacity_options(parser: argparse.ArgumentParser) -> None:
    """The batch the engine runs and the backlog past which requests are refused
    (docs/operating/capacity.md), with vLLM's names."""
    add_option(
        parser,
        "--max-num-seqs",
        "MAX_NUM_SEQS",
        None,
        "sequences the engine runs at once (per data-parallel rank); unset: vLLM's default "
        "for the device, as `vllm serve` has it (128 on a CPU, 256 on most GPUs, 1024 on an "
        "H100/H200)",
        positive_int,
    )
    add_option(
        parser,
        "--max-num-queued-reqs",
        "MAX_NUM_QUEUED_REQS",
        None,
        "sequences waiting or running (a request counts prompts x n, best_of or beam width) "
        f"past which requests are refused with 429; unset: {QUEUED_BATCHES} x the batch",
        positive_int,
    )
    add_option(
        parser,
        "--max-num-queued-tokens",
        "MAX_NUM_QUEUED_TOKENS",
        None,
        "prompt tokens waiting to be prefilled at which requests are refused with 429 (a "
        f"time-to-first-token budget); unset: {QUEUED_PREFILL_STEPS} engine steps' worth "
        "(x max_num_batched_tokens), and at least max_model_len",
        positive_int,
    )
    add_removed_option(
        parser,
        "--max-in-flight",
        "MAX_IN_FLIGHT",
        "the engine decides the batch: --max-num-seqs (MAX_NUM_SEQS) caps the sequences it "
        "runs at once, --max-num-queued-reqs (MAX_NUM_QUEUED_REQS) those waiting or running",
    )
    add_removed_option(
        parser,
        "--max-waiting",
        "MAX_WAITING",
        "requests wait in the engine: --max-num-queued-reqs (MAX_NUM_QUEUED_REQS) bounds the "
        "sequences waiting or running, --max-num-queued-tokens (MAX_NUM_QUEUED_TOKENS) the "
        "prompt tokens waiting to be prefilled",
    )


def cpu_core_list(text: str) -> tuple[int, ...]:
    try:
        return parse_core_list(text, available_cores())
    except PlacementError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


cpu_core_list.__name__ = "core list"  # argparse: "invalid core list value"


def port_list(text: str) -> tuple[int, ...]:
    try:
        ports = tuple(int(item) for item in text.split(","))
    except ValueError:
        ports = ()
    if not ports or not all(0 < port < 65536 for port in ports):
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of ports such as 50052,50053")
    return ports


port_list.__name__ = "port list"


def device_list(text: str) -> str:
    devices = [item.strip() for item in text.split(",")]
    if not all(devices):
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of devices such as 0,1")
    return ",".join(devices)


def add_placement_options(parser: argparse.ArgumentParser) -> None:
    add_option(
        parser,
        "--cpu-cores",
        "CPU_CORES",
        None,
        "CPU cores the engine's threads run on, e.g. 0-3 or 0,2 (split evenly over tensor x "
        "pipeline parallel workers); give each replica of a host its own; unset: vLLM binds "
        "automatically, the same cores for every replica",
        cpu_core_list,
    )
    add_option(
        parser,
        "--gpu-devices",
        "GPU_DEVICES",
        None,
        "GPU build: the devices the engine sees (CUDA_VISIBLE_DEVICES), e.g. 0,1; give each "
        "replica of a host its own; unset: all",
        device_list,
    )


def add_lora_options(parser: argparse.ArgumentParser, defaults: dict[str, Any]) -> None:
    env = os.environ.get("LORA_MODULES") or ""
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        type=lora_modules,
        action=Flatten,
        # A text default is converted like a flag's value (a bad one is a usage error).
        default=env or (),
        metavar="NAME=PATH",
        help="LoRA adapters served on the base model, each under its NAME (a request's "
        "`model`); PATH is a PEFT adapter directory [env LORA_MODULES, comma-separated; "
        "default: none]",
    )
    add_option(
        parser,
        "--max-loras",
        "MAX_LORAS",
        defaults["max_loras"],
        "LoRA adapters that run in one batch",
        positive_int,
    )
    add_option(
        parser,
        "--max-lora-rank",
        "MAX_LORA_RANK",
        defaults["max_lora_rank"],
        "the largest adapter rank served (vLLM allows 1, 8, 16, 32, 64, 128, 256, 320, 512)",
        positive_int,
    )
    add_option(
        parser,
        "--lora-target-modules",
        "LORA_TARGET_MODULES",
        None,
        "the only modules given LoRA layers, comma-separated (e.g. q_proj,v_proj, or vLLM's "
        "packed qkv_proj): each step then runs fewer of them, and an adapter changing any "
        "other module is refused (None: every module the model supports)",
        module_names,
    )
    add_runtime_adapter_options(parser, defaults)


def add_runtime_adapter_options(parser: argparse.ArgumentParser, defaults: dict[str, Any]) -> None:
    add_option(
        parser,
        "--adapter-root",
        "ADAPTER_ROOT",
        None,
        "a directory of LoRA adapters, one subdirectory each, served by the subdirectory's "
        "name: loaded on first use, retired within seconds of its directory's removal or "
        "change; load calls take paths only inside it",
        Path,
    )
    add_switch(
        parser,
        "--enable-adapter-loading",
        "ENABLE_ADAPTER_LOADING",
        "accept LoadLoraAdapter and UnloadLoraAdapter calls (only with the operator key)",
    )
    add_option(
        parser,
        "--max-cpu-loras",
        "MAX_CPU_LORAS",
        None,
        "adapters held in the engine's memory, those of --lora-modules included; the least "
        "recently used idle one is evicted for a new one (unset: --lora-modules' count, plus "
        "--max-loras when adapters come at runtime)",
        positive_int,
    )
    add_option(
        parser,
        "--max-adapters",
        "MAX_ADAPTERS",
        defaults["max_adapters"],
        "adapters loaded by call at once",
        positive_int,
    )
    add_option(
        parser,
        "--max-adapter-bytes",
        "MAX_ADAPTER_BYTES",
        defaults["max_adapter_bytes"],
        "the largest adapter (its files' total bytes) loaded at runtime",
        positive_int,
    )
    add_option(
        parser,
        "--adapter-drain-seconds",
        "ADAPTER_DRAIN_SECONDS",
        defaults["adapter_drain_seconds"],
        "how long calls running on an unloaded or replaced adapter may go on before they are "
        "ended with an error",
        positive_float,
    )


def add_limit_options(parser: argparse.ArgumentParser) -> None:
    defaults = RequestLimits()
    server = ServerSettings()
    add_option(
        parser,
        "--max-prompts",
        "MAX_PROMPTS",
        defaults.max_prompts,
        "prompts per request",
        positive_int,
    )
    add_option(
        parser,
        "--max-choices",
        "MAX_CHOICES",
        defaults.max_choices,
        "prompts x n (or best_of) per request",
        positive_int,
    )
    add_option(
        parser,
        "--max-prompt-tokens",
        "MAX_PROMPT_TOKENS",
        defaults.max_prompt_tokens,
        "prompt tokens per request, over all prompts",
        positive_int,
    )
    add_option(
        parser,
        "--max-constraint-bytes",
        "MAX_CONSTRAINT_BYTES",
        defaults.max_constraint_bytes,
        "size of a schema, regex, grammar, choices or the stop strings",
        positive_int,
    )
    add_option(
        parser,
        "--max-logit-bias",
        "MAX_LOGIT_BIAS",
        defaults.max_logit_bias,
        "logit_bias entries per request",
        non_negative_int,
    )
    add_option(
        parser,
        "--max-message-bytes",
        "MAX_MESSAGE_BYTES",
        server.max_message_bytes,
        "largest gRPC message received or sent (a whole reply is one message)",
        positive_int,
    )


def add_server_options(serve: argparse.ArgumentParser) -> None:
    defaults = ServerSettings()
    add_option(serve, "--host", "GRPC_HOST", defaults.host, "address the gRPC server listens on")
    add_option(serve, "--port", "GRPC_PORT", defaults.port, "gRPC port", int)
    add_option(
        serve,
        "--api-key",
        "API_KEY",
        None,
        "require `authorization: Bearer <key>` on completion calls (health and reflection "
        "stay open); several keys, comma-separated, are several callers (a request is "
        "cancelled only by its own caller's key)",
        secret=True,
    )
    add_option(
        serve,
        "--operator-api-key",
        "OPERATOR_API_KEY",
        None,
        "the key (or keys, comma-separated) that may call LoadLoraAdapter and "
        "UnloadLoraAdapter; no caller key ever may",
        secret=True,
    )
    add_option(
        serve,
        "--tenants-file",
        "TENANTS_FILE",
        None,
        "YAML of tenants, each with its keys (SHA-256 hashes), the models it may reach and "
        "its limits; reloaded within seconds of a change (docs/operating/tenants.md). With "
        "--api-key too, those keys are callers that may reach every model",
        Path,
    )
    add_option(
        serve,
        "--limits-store",
        "LIMITS_STORE",
        defaults.limits_store,
        "where tenants' request and token windows are kept: memory:// (exact on one "
        "replica) or redis://HOST:PORT (one budget per tenant across every replica)",
        limits_store_url,
    )
    add_switch(
        serve,
        "--limits-fail-closed",
        "LIMITS_FAIL_CLOSED",
        "refuse tenants' calls (UNAVAILABLE) while the limits store fails, instead of letting "
        "them pass",
    )
    add_option(
        serve,
        "--api-server-count",
        "API_SERVER_COUNT",
        defaults.api_server_count,
        "frontend processes serving calls over the one engine core, as `vllm serve "
        "--api-server-count` (1 on a CPU: its cores go to the engine; on a GPU host, enough to "
        "keep up with the engine's tokens: see docs on capacity)",
        positive_int,
    )
    add_option(
        serve,
        "--frontend-ports",
        "FRONTEND_PORTS",
        None,
        "with --api-server-count N > 1, each frontend's own port, comma-separated (default: "
        "the N ports after --port); Envoy balances streams over them",
        port_list,
    )
    add_option(serve, "--metrics-host", "METRICS_HOST", defaults.metrics_host, "Prometheus address")
    add_option(
        serve, "--metrics-port", "METRICS_PORT", defaults.metrics_port, "Prometheus port", int
    )
    add_switch(serve, "--log-prompts", "LOG_PROMPTS", "log prompts and outputs in request lines")
    add_tracing_option(serve)
    add_switch(
        serve,
        "--enable-per-request-metrics",
        "ENABLE_PER_REQUEST_METRICS",
        "every reply carries its request's timings (`metrics`), as if asked with return_metrics",
    )
    add_option(
        serve,
        "--drain-delay",
        "DRAIN_DELAY_SECONDS",
        defaults.drain_delay_seconds,
        "on SIGTERM, seconds to keep accepting requests after health turns NOT_SERVING, "
        "so that a load balancer's health checks notice first (e.g. 5 behind Envoy: "
        "longer than its 2 s check interval plus 1 s timeout)",
        float,
    )
    add_option(
        serve,
        "--shutdown-grace",
        "SHUTDOWN_GRACE_SECONDS",
        defaults.shutdown_grace_seconds,
        "on SIGTERM, how long the requests in flight may still run once the listener has "
        "closed: the drain ends as soon as they finish; any still running then are cancelled",
        float,
    )


def add_chat_options(serve: argparse.ArgumentParser) -> None:
    """Chat rendering and parsing, as `vllm serve`'s flags of the same names."""
    add_option(
        serve,
        "--chat-template",
        "CHAT_TEMPLATE",
        None,
        "a Jinja chat template file; unset: the model's own",
        Path,
    )
    add_switch(
        serve,
        "--trust-request-chat-template",
        "TRUST_REQUEST_CHAT_TEMPLATE",
        "let a chat request bring its own `chat_template` (else it is refused)",
    )
    add_option(
        serve,
        "--tool-call-parser",
        "TOOL_CALL_PARSER",
        None,
        "parse tool calls out of chat replies with this vLLM parser (e.g. hermes, llama3_json, "
        "mistral); unset: named and required tool choice only",
    )
    add_switch(
        serve,
        "--enable-auto-tool-choice",
        "ENABLE_AUTO_TOOL_CHOICE",
        'let the model decide whether to call a tool (tool_choice "auto"); needs '
        "--tool-call-parser",
    )
    add_option(
        serve,
        "--reasoning-parser",
        "REASONING_PARSER",
        None,
        "split the model's reasoning from a chat reply's content with this vLLM parser "
        "(e.g. deepseek_r1, qwen3); unset: none",
    )


def chat_settings(args: argparse.Namespace) -> ChatSettings:
    return ChatSettings(
        chat_template=args.chat_template,
        trust_request_chat_template=args.trust_request_chat_template,
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        reasoning_parser=args.reasoning_parser,
        media=MediaSettings(
            max_bytes=args.max_media_bytes,
            max_pixels=args.max_image_pixels,
            fetch_timeout_seconds=args.media_fetch_timeout,
        ),
    )


HOST_NAME = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.:-]+)$")


def host_names(text: str) -> tuple[str, ...]:
    """Host names separated by commas, each exactly as URLs name it (no scheme or port)."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    for name in names:
        if not HOST_NAME.match(name) or name.count(":") == 1:
            raise argparse.ArgumentTypeError(
                f"{name!r} is not a host name; give names alone, e.g. images.example.com,"
                "10.0.0.7 (no scheme, port or path)"
            )
    return names


host_names.__name__ = "host list"  # argparse: "invalid host list value"

BUCKET = re.compile(r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[^/\s]+)*$")


def bucket_prefixes(text: str) -> tuple[str, ...]:
    """s3://BUCKET or s3://BUCKET/PREFIX, separated by commas (a trailing slash dropped)."""
    prefixes = tuple(item.strip().rstrip("/") for item in text.split(",") if item.strip())
    for prefix in prefixes:
        if not BUCKET.match(prefix) or {".", ".."} & set(prefix.split("/")[3:]):
            raise argparse.ArgumentTypeError(
                f"{prefix!r} is not a bucket; give s3://BUCKET or s3://BUCKET/PREFIX, e.g. "
                "s3://team-jobs,s3://shared/evals"
            )
    return prefixes


bucket_prefixes.__name__ = "bucket list"


def items_per_prompt(text: str) -> dict[str, Any]:
    """vLLM's --limit-mm-per-prompt form: a JSON object of counts (or of {"count": N, ...})
    by modality."""
    limits = json_object(text)
    for modality, limit in limits.items():
        count = limit.get("count") if isinstance(limit, dict) else limit
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise argparse.ArgumentTypeError(
                f"{modality!r} needs a count of 0 or more, e.g. '{{\"image\": 2}}'"
            )
    return limits


items_per_prompt.__name__ = "JSON object"


def non_negative_float(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be 0 or more")
    return value


non_negative_float.__name__ = "float"


def add_media_options(serve: argparse.ArgumentParser) -> None:
    """Images in chat messages (a model that takes them): what the fetcher may reach, and what
    one image and one prompt may hold."""
    media = MediaSettings()
    add_option(
        serve,
        "--allowed-media-domains",
        "ALLOWED_MEDIA_DOMAINS",
        None,
        "image URLs may name only these hosts (exact names, comma-separated; each exempt from "
        "the address check, so an internal image store can be allowed on purpose); unset: "
        "any host whose addresses are all public",
        host_names,
    )
    add_option(
        serve,
        "--limit-mm-per-prompt",
        "LIMIT_MM_PER_PROMPT",
        json.dumps({"image": DEFAULT_IMAGES_PER_PROMPT}),
        "media items one request may hold, by modality, as vLLM's JSON form, counted before "
        "any is fetched",
        items_per_prompt,
    )
    add_option(
        serve,
        "--max-media-bytes",
        "MAX_MEDIA_BYTES",
        media.max_bytes,
        "bytes one image may have, inline or downloaded (a download stops there)",
        positive_int,
    )
    add_option(
        serve,
        "--max-image-pixels",
        "MAX_IMAGE_PIXELS",
        media.max_pixels,
        "pixels (width x height) an image may declare; checked before it is decoded",
        positive_int,
    )
    add_option(
        serve,
        "--media-fetch-timeout",
        "MEDIA_FETCH_TIMEOUT",
        media.fetch_timeout_seconds,
        "seconds one image's download may take, from connecting to its last byte (one "
        "attempt, no retries)",
        positive_float,
    )
    add_option(
        serve,
        "--mm-processor-cache-gb",
        "MM_PROCESSOR_CACHE_GB",
        None,
        "GiB of processed images each frontend and engine core process keeps for reuse "
        "(vLLM's flag; 0: none); unset: vLLM's default, 4",
        non_negative_float,
    )


def add_batch_options(serve: argparse.ArgumentParser) -> None:
    """Offline jobs (POST /v2/batch-completions): where their files may be, how large."""
    defaults = BatchSettings(default_batch_root())
    add_option(
        serve,
        "--batch-root",
        "BATCH_ROOT",
        defaults.root,
        "batch jobs' input and output files must lie inside this directory (their durable "
        "records are kept in it too)",
        Path,
    )
    add_option(
        serve,
        "--batch-buckets",
        "BATCH_BUCKETS",
        defaults.buckets,
        "S3 buckets (s3://BUCKET or s3://BUCKET/PREFIX, comma-separated) where batch jobs' files "
        "may also be, read and written with the environment's AWS settings (AWS_ENDPOINT_URL "
        "for another S3-compatible store); none by default",
        bucket_prefixes,
    )
    add_option(
        serve,
        "--batch-max-lines",
        "BATCH_MAX_LINES",
        defaults.max_lines,
        "requests one batch job may hold",
        positive_int,
    )
    add_option(
        serve,
        "--batch-max-input-bytes",
        "BATCH_MAX_INPUT_BYTES",
        defaults.max_input_bytes,
        "bytes a batch job's input file may have",
        positive_int,
    )
    add_option(
        serve,
        "--batch-takeover-seconds",
        "BATCH_TAKEOVER_SECONDS",
        defaults.takeover_seconds,
        "how often shards of unfinished jobs that no process runs are looked for and taken: "
        "another replica's new job's (data_parallelism above 1), or a dead process's",
        positive_float,
    )


def batch_settings(args: argparse.Namespace) -> BatchSettings:
    return BatchSettings(
        root=args.batch_root.expanduser(),
        buckets=args.batch_buckets,
        max_lines=args.batch_max_lines,
        max_input_bytes=args.batch_max_input_bytes,
        takeover_seconds=args.batch_takeover_seconds,
    )


def add_transport_options(serve: argparse.ArgumentParser) -> None:
    """Keepalive and TLS on the gRPC listener."""
    keepalive = KeepaliveSettings()
    add_option(
        serve,
        "--keepalive-time",
        "KEEPALIVE_TIME_SECONDS",
        keepalive.time_seconds,
        "seconds a connection may stay silent before the server pings it",
        positive_float,
    )
    add_option(
        serve,
        "--keepalive-timeout",
        "KEEPALIVE_TIMEOUT_SECONDS",
        keepalive.timeout_seconds,
        "seconds a ping may go unanswered before the connection is closed and its calls "
        "(and their engine requests) are cancelled",
        positive_float,
    )
    add_option(
        serve,
        "--keepalive-min-ping-interval",
        "KEEPALIVE_MIN_PING_INTERVAL_SECONDS",
        keepalive.min_ping_interval_seconds,
        "callers' pings closer together than this count as strikes",
        positive_float,
    )
    add_option(
        serve,
        "--keepalive-max-ping-strikes",
        "KEEPALIVE_MAX_PING_STRIKES",
        keepalive.max_ping_strikes,
        "strikes before the server ends a connection with GOAWAY too_many_pings; 0: never",
        non_negative_int,
    )
    add_option(
        serve,
        "--tls-cert-file",
        "TLS_CERT_FILE",
        None,
        "serve TLS with this PEM certificate (chain); re-read when it changes; unset: plaintext",
        Path,
    )
    add_option(serve, "--tls-key-file", "TLS_KEY_FILE", None, "its PEM private key", Path)
    add_option(
        serve,
        "--tls-client-ca-file",
        "TLS_CLIENT_CA_FILE",
        None,
        "require client certificates signed by these PEM CA certificates (mutual TLS)",
        Path,
    )


def engine_settings(args: argparse.Namespace) -> EngineSettings:
    served_name = args.served_model_name or (
        DEFAULT_SERVED_MODEL_NAME if args.model is None else args.model.resolve().name
    )
    return EngineSettings(
        model=args.model,
        served_model_name=served_name,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        kv_cache_gib=args.kv_cache_gib,
        structured_outputs_backend=args.structured_outputs_backend,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        data_parallel_size=args.data_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend,
        scheduling_policy=args.scheduling_policy,
        max_num_seqs=args.max_num_seqs,
        max_num_queued_reqs=args.max_num_queued_reqs,
        max_num_queued_tokens=args.max_num_queued_tokens,
        cpu_cores=args.cpu_cores or (),
        gpu_devices=args.gpu_devices,
        lora_modules=tuple(args.lora_modules),
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        lora_target_modules=args.lora_target_modules,
        adapter_root=args.adapter_root,
        enable_adapter_loading=args.enable_adapter_loading,
        max_cpu_loras=args.max_cpu_loras,
        max_adapters=args.max_adapters,
        max_adapter_bytes=args.max_adapter_bytes,
        adapter_drain_seconds=args.adapter_drain_seconds,
        max_logprobs=ENGINE_MAX_LOGPROBS,
        extra_engine_args=args.engine_args,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        allowed_media_domains=args.allowed_media_domains,
        limit_mm_per_prompt=args.limit_mm_per_prompt,
        mm_processor_cache_gb=args.mm_processor_cache_gb,
    )


def frontend_ports_problem(settings: ServerSettings) -> str | None:
    """What is wrong with the frontends' own ports, if anything."""
    ports = settings.own_ports()
    if settings.api_server_count > 1 and len(ports) != settings.api_server_count:
        return (
            f"--frontend-ports lists {len(ports)} ports for --api-server-count "
            f"{settings.api_server_count}: give one per frontend"
        )
    if settings.api_server_count > 1 and (settings.port in ports or len(set(ports)) < len(ports)):
        return "--frontend-ports must differ from --port and from each other"
    return None


def server_settings(args: argparse.Namespace) -> ServerSettings:
    return ServerSettings(
        host=args.host,
        port=args.port,
        api_server_count=args.api_server_count,
        frontend_ports=args.frontend_ports or (),
        shutdown_grace_seconds=args.shutdown_grace,
        drain_delay_seconds=args.drain_delay,
        api_key=args.api_key,
        operator_api_key=args.operator_api_key,
        tenants_file=args.tenants_file,
        limits_store=args.limits_store,
        limits_fail_closed=args.limits_fail_closed,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        log_prompts=args.log_prompts,
        per_request_metrics=args.enable_per_request_metrics,
        max_message_bytes=args.max_message_bytes,
        limits=RequestLimits(
            max_prompts=args.max_prompts,
            max_choices=args.max_choices,
            max_prompt_tokens=args.max_prompt_tokens,
            max_constraint_bytes=args.max_constraint_bytes,
            max_logit_bias=args.max_logit_bias,
        ),
        keepalive=KeepaliveSettings(
            time_seconds=args.keepalive_time,
            timeout_seconds=args.keepalive_timeout,
            min_ping_interval_seconds=args.keepalive_min_ping_interval,
            max_ping_strikes=args.keepalive_max_ping_strikes,
        ),
        tls=tls_settings(args.tls_cert_file, args.tls_key_file, args.tls_client_ca_file),
        chat=chat_settings(args),
        batch=batch_settings(args),
        tracing=tracing_settings(args.otlp_traces_endpoint, DEFAULT_TRACING_NAME),
    )


def limits_store_url(text: str) -> str:
    """memory:// or a Redis URL (redis://, rediss://, redis+sentinel://, redis+cluster://)."""
    from service.api.rate_limits import store_problem

    schemes = ("memory://", "redis://", "rediss://", "redis+sentinel://", "redis+cluster://")
    if not text.startswith(schemes):
        raise argparse.ArgumentTypeError(f"expected memory:// or redis://HOST:PORT, got {text!r}")
    if (problem := store_problem(text)) is not None:
        raise argparse.ArgumentTypeError(f"{text!r}: {problem}")
    return text
