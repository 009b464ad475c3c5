"""The service's configuration, as parsed from flags and environment variables."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plumbing.keepalive import KeepaliveSettings
from plumbing.ports import DEFAULT_GRPC_PORT, frontend_ports
from plumbing.tls import TlsSettings
from plumbing.tracing import TracingSettings

# Images one prompt may hold unless the operator says otherwise (vLLM's own default is 999):
# each may be a fetch of up to MediaSettings.max_bytes.
DEFAULT_IMAGES_PER_PROMPT = 8


@dataclass(frozen=True)
class LoraModule:
    """A LoRA adapter to serve: callers pass `name` as `model`; `path` is its PEFT directory."""

    name: str
    path: Path


@dataclass(frozen=True)
class EngineSettings:
    """What the vLLM engine is built from."""

    model: Path | None  # None: the embedded default model
    served_model_name: str
    dtype: str = "auto"  # "auto" means float32 on a CPU
    max_model_len: int | None = None
    kv_cache_gib: float | None = None
    structured_outputs_backend: str = "xgrammar"
    # vLLM's own model parallelism: shards over devices (tensor), layers over stages or nodes
    # (pipeline), and engine replicas inside one server (data).
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # "mp" or "ray"; None lets vLLM choose
    # Where the engine runs: its CPU cores (none: vLLM's automatic binding), or on a GPU build
    # the devices it sees (None: all).
    cpu_cores: tuple[int, ...] = ()
    gpu_devices: str | None = None
    # The order waiting requests run in: "fcfs" (arrival) or "priority" (a request's
    # `priority`, lower first).
    scheduling_policy: str = "fcfs"
    # Sequences the engine runs at once (None: vLLM's default for the device, as `vllm
    # serve` resolves it), and the backlog past which requests are refused: sequences
    # waiting or running, prompt tokens not yet prefilled (None: derived from the batch,
    # service.model.capacity).
    max_num_seqs: int | None = None
    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None
    # LoRA adapters on the base model, each served under its own name (none: LoRA off).
    lora_modules: tuple[LoraModule, ...] = ()
    max_loras: int = 1  # adapters in one batch
    max_lora_rank: int = 16  # the largest adapter rank the engine accepts
    # The only modules given LoRA layers (None: every one the model supports).
    lora_target_modules: tuple[str, ...] | None = None
    # Adapters that come and go while the server runs (service.model.adapter_registry): a
    # directory of adapters served by their directory's name, and load/unload calls.
    adapter_root: Path | None = None
    enable_adapter_loading: bool = False
    # Adapters held in the engine's memory, those given at start included (None: those plus
    # --max-loras more when adapters come at runtime, as many as given otherwise).
    max_cpu_loras: int | None = None
    max_adapters: int = 64  # adapters loaded by call at once
    max_adapter_bytes: int = 1024**3  # the files of one adapter
    # How long an unloaded adapter's running calls may go on before they are ended.
    adapter_drain_seconds: float = 30.0
    # The log-probabilities a request may ask for per step (None: vLLM's default); the API's
    # requests need service.api.declared_ranges.ENGINE_MAX_LOGPROBS.
    max_logprobs: int | None = None
    extra_engine_args: dict[str, Any] = field(default_factory=dict)
    # vLLM's request spans (`llm_request`) go here; None: no tracing.
    otlp_traces_endpoint: str | None = None
    # Images (and other media) in chat messages, on a model that takes them: the only hosts
    # URLs may name (None: any host at a public address), the items a prompt may hold by
    # modality (vLLM's --limit-mm-per-prompt form), and the processed-input cache of each
    # process (GiB; None: vLLM's default).
    allowed_media_domains: tuple[str, ...] | None = None
    limit_mm_per_prompt: dict[str, Any] = field(
        default_factory=lambda: {"image": DEFAULT_IMAGES_PER_PROMPT}
    )
    mm_processor_cache_gb: float | None = None

    @property
    def runtime_adapters(self) -> bool:
        """Whether adapters may come and go while the server runs."""
        return self.adapter_root is not None or self.enable_adapter_loading

    @property
    def lora_enabled(self) -> bool:
        return bool(self.lora_modules) or self.runtime_adapters

    @property
    def resident_adapters(self) -> int:
        """How many adapters the engine holds in memory (vLLM's max_cpu_loras)."""
        if self.max_cpu_loras is not None:
            return self.max_cpu_loras
        room = self.max_loras if self.runtime_adapters else 0
        return max(self.max_loras, len(self.lora_modules) + room)


@dataclass(frozen=True)
class RequestLimits:
    """Size limits on one request, each refused with a validation error naming the field."""

    max_prompts: int = 64
    max_choices: int = 256  # prompts x (best_of or n)
    max_prompt_tokens: int = 65536  # over all prompts; each must also fit the context
    max_constraint_bytes: int = 65536  # guided_json/schema, regex, grammar, choices, stop
    max_logit_bias: int = 1024


@dataclass(frozen=True)
class MediaSettings:
    """How the media fetcher (service.api.media) reads an image a chat message names: the
    bounds on one image. Which hosts it may reach and how many images a prompt may hold are
    engine settings (vLLM's model config carries them)."""

    max_bytes: int = 10 * 1024 * 1024  # one image, encoded: a 12-megapixel JPEG is 3-6 MB
    max_pixels: int = 4096 * 4096  # declared width x height, checked before decoding
    fetch_timeout_seconds: float = 10.0  # one attempt, connect to last byte


@dataclass(frozen=True)
class ChatSettings:
    """How chat requests are rendered and their replies parsed, with the names and meanings of
    `vllm serve`'s flags."""

    # A Jinja chat template file (None: the model's own, from its tokenizer config or its
    # chat_template.jinja).
    chat_template: Path | None = None
    trust_request_chat_template: bool = False  # a request's own `chat_template` is used
    tool_call_parser: str | None = None  # e.g. "hermes": tool calls parsed out of the output
    enable_auto_tool_choice: bool = False  # `tool_choice: "auto"`: needs tool_call_parser
    reasoning_parser: str | None = None  # reasoning split from the content of a reply
    media: MediaSettings = field(default_factory=MediaSettings)  # images in messages


@dataclass(frozen=True)
class BatchSettings:
    """Offline jobs (service.api.batch): the only directory their files may be in (their
    records are kept there too), and the size of one job."""

    root: Path
    # s3://BUCKET or s3://BUCKET/PREFIX (no trailing slash): where else a job's files may be.
    buckets: tuple[str, ...] = ()
    max_lines: int = 50_000
    max_input_bytes: int = 256 * 1024 * 1024
    # How often shards nobody runs are looked for: another replica's new job's (split over
    # data_parallelism), or those of a process on the root that died.
    takeover_seconds: float = 5.0


def default_batch_root() -> Path:
    """The batch root when none is given: beside the prepared models."""
    from service.model.default_model import cache_root

    return cache_root() / "batch"


@dataclass(frozen=True)
class ServerSettings:
    """Where and how the gRPC server listens."""

    host: str = "127.0.0.1"
    port: int = DEFAULT_GRPC_PORT
    shutdown_grace_seconds: float = 30.0
    drain_delay_seconds: float = 0.0  # behind a balancer: serve on while it notices NOT_SERVING
    # Once the requests are done, the engine gets this long to exit before its processes are
    # killed (vLLM's default, 5 s, is spent waiting for its worker process's teardown).
    engine_stop_seconds: float = 1.0
    max_message_bytes: int = 16 * 1024 * 1024
    api_key: str | None = None  # when set, completion calls need `authorization: Bearer <key>`
    operator_api_key: str | None = None  # the keys that may load and unload adapters
    tenants_file: Path | None = None  # tenants with their keys, models and limits (YAML)
    limits_store: str = "memory://"  # where tenants' windows are kept (a Redis URL: shared)
    limits_fail_closed: bool = False  # refuse calls while the store fails (else let them pass)
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = 9400  # None: no metrics endpoint
    log_prompts: bool = False
    per_request_metrics: bool = False  # every reply carries `metrics`, asked for or not
    limits: RequestLimits = field(default_factory=RequestLimits)
    keepalive: KeepaliveSettings = field(default_factory=KeepaliveSettings)
    tls: TlsSettings | None = None  # None: plaintext
    chat: ChatSettings = field(default_factory=ChatSettings)
    tracing: TracingSettings | None = None  # None: no tracing
    # Frontend processes over the one engine core (vLLM's --api-server-count): each listens on
    # `port` (shared, SO_REUSEPORT) and on its own port, by default the ones after `port`.
    api_server_count: int = 1
    frontend_ports: tuple[int, ...] = ()
    batch: BatchSettings = field(default_factory=lambda: BatchSettings(default_batch_root()))

    def own_ports(self) -> tuple[int, ...]:
        """Each frontend's own port: as given, else the `api_server_count` after `port`."""
        return frontend_ports(self.port, self.api_server_count, self.frontend_ports)
