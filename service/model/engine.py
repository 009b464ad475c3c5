"""The model layer: builds vLLM's in-process async engine and describes the model it serves."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm import AsyncEngineArgs, envs
from vllm.config import StructuredOutputsConfig, VllmConfig
from vllm.platforms import current_platform
from vllm.tokenizers import TokenizerLike
from vllm.usage.usage_lib import UsageContext
from vllm.v1.engine.async_llm import AsyncLLM

from service.model.adapter_registry import AdapterRegistry
from service.model.adapters import ModelCatalog, build_catalog
from service.model.capacity import Capacity, resolve_capacity
from service.model.default_model import model_directory
from service.model.in_core_worker import engine_core_environment, place_worker
from service.model.lifetime import mark_engine_parent
from service.model.load import EngineLoad
from service.model.placement import confine_engine_core, place_engine
from service.model.standby_core import Standby
from service.settings import EngineSettings

if TYPE_CHECKING:
    from service.model.frontends import FrontendLink

logger = logging.getLogger(__name__)

GIB = 1024**3
# vLLM's CPU default reserves 92% of the NUMA node's memory, which fails whenever anything
# else runs on the node; a fixed KV cache starts reliably (2 GiB: ~100k tokens of a 135M model).
DEFAULT_CPU_KV_CACHE_GIB = 2.0


@dataclass(frozen=True)
class ServedModel:
    """The running engine and the facts about its model that requests are checked against."""

    engine: AsyncLLM
    name: str
    tokenizer: TokenizerLike
    max_model_len: int
    vocab_size: int
    system_fingerprint: str
    default_sampling: dict[str, Any]
    structured_outputs_backend: str
    adapters: AdapterRegistry  # the served names: the base model's and its adapters'
    # Files the engine reads while it runs (the base model's stand-in adapter), removed after.
    scratch: tempfile.TemporaryDirectory[str]
    capacity: Capacity  # the batch the engine runs and the backlog it accepts
    load: EngineLoad  # how loaded it is now, for load reports
    eos_token_ids: tuple[int, ...] = ()
    scheduling_policy: str = "fcfs"  # "priority": requests' `priority` orders the queue


def resolve_dtype(dtype: str) -> str:
    # bfloat16 is emulated and slow on CPUs without AVX-512 BF16 (on the 2-core AMD EPYC
    # test machines float32 ran about 35x faster).
    if dtype == "auto" and current_platform.is_cpu():
        return "float32"
    return dtype


def lora_args(settings: EngineSettings, catalog: ModelCatalog) -> dict[str, Any]:
    """LoRA on when adapters are served (or may come at runtime), with a slot more for the base
    model's stand-in."""
    if not settings.lora_enabled:
        return {}
    extra = 1 if catalog.base_adapter is not None else 0
    args: dict[str, Any] = {
        "enable_lora": True,
        "max_loras": settings.max_loras + extra,
        "max_lora_rank": settings.max_lora_rank,
        "max_cpu_loras": settings.resident_adapters + extra,
    }
    if settings.lora_target_modules is not None:
        args["lora_target_modules"] = list(settings.lora_target_modules)
    return args


def media_args(settings: EngineSettings) -> dict[str, Any]:
    """What vLLM's model config holds of the media settings (a text-only model ignores it)."""
    args: dict[str, Any] = {"limit_mm_per_prompt": dict(settings.limit_mm_per_prompt)}
    if settings.allowed_media_domains is not None:
        args["allowed_media_domains"] = list(settings.allowed_media_domains)
    if settings.mm_processor_cache_gb is not None:
        args["mm_processor_cache_gb"] = settings.mm_processor_cache_gb
    return args


def engine_args(
    settings: EngineSettings, model_dir: Path, catalog: ModelCatalog
) -> AsyncEngineArgs:
    args: dict[str, Any] = {
        "model": str(model_dir),
        "served_model_name": settings.served_model_name,
        "dtype": resolve_dtype(settings.dtype),
        # torch.compile costs minutes at start on a CPU and buys little there.
        "enforce_eager": current_platform.is_cpu(),
        # Stats feed vLLM's Prometheus metrics (vllm:*), served with ours.
        "disable_log_stats": False,
        # vLLM runs one structured-output backend per engine; requests may only name it.
        "structured_outputs_config": StructuredOutputsConfig(
            backend=settings.structured_outputs_backend
        ),
        "scheduling_policy": settings.scheduling_policy,
    }
    batch = {
        "max_num_seqs": settings.max_num_seqs,
        "max_num_queued_reqs": settings.max_num_queued_reqs,
        "max_num_queued_tokens": settings.max_num_queued_tokens,
    }
    args.update({name: value for name, value in batch.items() if value is not None})
    if settings.max_logprobs is not None:
        args["max_logprobs"] = settings.max_logprobs
    args.update(
        tensor_parallel_size=settings.tensor_parallel_size,
        pipeline_parallel_size=settings.pipeline_parallel_size,
        data_parallel_size=settings.data_parallel_size,
    )
    if settings.distributed_executor_backend is not None:
        args["distributed_executor_backend"] = settings.distributed_executor_backend
    if settings.max_model_len is not None:
        args["max_model_len"] = settings.max_model_len
    kv_cache_gib = settings.kv_cache_gib
    if kv_cache_gib is None and current_platform.is_cpu():
        kv_cache_gib = DEFAULT_CPU_KV_CACHE_GIB
    if kv_cache_gib is not None:
        args["kv_cache_memory_bytes"] = int(kv_cache_gib * GIB)
    args.update(lora_args(settings, catalog))
    args.update(media_args(settings))
    if settings.otlp_traces_endpoint:
        args["otlp_traces_endpoint"] = settings.otlp_traces_endpoint  # vLLM's request spans
    args.update(settings.extra_engine_args)
    return AsyncEngineArgs(**args)


# Engine arguments that change nothing the model generates.
# (A frontend's rank among several is not configuration either: every one answers alike.)
NOT_CONFIGURATION = frozenset({"otlp_traces_endpoint", "_api_process_count", "_api_process_rank"})


def fingerprint(args: AsyncEngineArgs) -> str:
    """Stable for one model and engine configuration, as `system_fingerprint` promises."""
    import vllm

    configuration = {k: str(v) for k, v in vars(args).items() if k not in NOT_CONFIGURATION}
    described = {"vllm": vllm.__version__, "args": configuration}
    digest = hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()
    return f"fp_{digest[:12]}"


def eos_token_ids(engine: AsyncLLM) -> tuple[int, ...]:
    """The tokenizer's end-of-sequence id and those of the model's generation config."""
    found = {engine.get_tokenizer().eos_token_id}
    configured = engine.model_config.try_get_generation_config().get("eos_token_id")
    found.update(configured if isinstance(configured, list) else [configured])
    return tuple(sorted(token for token in found if isinstance(token, int)))


def prepare_engine_processes(settings: EngineSettings, scratch: Path) -> None:
    """Before the engine core starts: its processes die with this one, and run where the
    settings place them."""
    mark_engine_parent(scratch)
    place_engine(
        settings.cpu_cores,
        settings.gpu_devices,
        ranks=settings.tensor_parallel_size * settings.pipeline_parallel_size,
        on_cpu=current_platform.is_cpu(),
    )


def api_server_config(args: AsyncEngineArgs, frontends: int = 1, rank: int = 0) -> VllmConfig:
    """Resolved as `vllm serve` resolves it: the batch size and step follow the device for an
    API server (vLLM's generic defaults, for the engine used as a library, do not). With several
    frontends, `rank` is this one's (-1: the parent that launches the engine core)."""
    if frontends > 1:
        args._api_process_count = frontends
        args._api_process_rank = rank
    config = args.create_engine_config(UsageContext.OPENAI_API_SERVER)
    place_worker(config, args.distributed_executor_backend)
    return config


def start_engine(
    settings: EngineSettings, link: FrontendLink | None = None, standby: Standby | None = None
) -> ServedModel:
    """Build the engine (blocking: run it off the event loop): in this process's care (its
    engine core the `standby` copy, where one was made), or with a `link`, as one frontend of an
    engine core its parent process launched."""
    model_dir = model_directory(settings.model)
    scratch = tempfile.TemporaryDirectory(prefix="llm-completions-")
    catalog = build_catalog(settings, Path(scratch.name))
    args = engine_args(settings, model_dir, catalog)
    logger.info(
        "starting engine: model=%s served_as=%s dtype=%s%s",
        model_dir,
        settings.served_model_name,
        args.dtype,
        "" if link is None else f" (frontend {link.index} of {link.count})",
    )
    # The periodic throughput log line would drown the one-line-per-request log.
    logging.getLogger("vllm.v1.metrics.loggers").setLevel(logging.WARNING)
    if link is None:
        prepare_engine_processes(settings, Path(scratch.name))
    config = api_server_config(args, *(() if link is None else (link.count, link.index)))
    capacity = resolve_capacity(config)
    load = EngineLoad(capacity.max_num_seqs, capacity.max_num_queued_reqs)
    with engine_core_environment(config, standby) if link is None else contextlib.nullcontext():
        engine = AsyncLLM.from_vllm_config(
            config,
            usage_context=UsageContext.OPENAI_API_SERVER,
            disable_log_stats=args.disable_log_stats,
            stat_loggers=[load.stat_logger],
            **({} if link is None else link.client_arguments()),
        )
    if link is None and current_platform.is_cpu():
        confine_engine_core()
    # vLLM reads some of its settings from the environment for every generated token (1.9 us a
    # read, 0.3 cached). Nothing here changes them once the engine runs: cache them, as vLLM's
    # engine core does in its own process.
    envs.enable_envs_cache()
    model_config = engine.model_config
    served = ServedModel(
        engine=engine,
        name=settings.served_model_name,
        tokenizer=engine.get_tokenizer(),
        max_model_len=model_config.max_model_len,
        vocab_size=model_config.get_vocab_size(),
        system_fingerprint=fingerprint(args),
        default_sampling=model_config.get_diff_sampling_param(),
        structured_outputs_backend=engine.vllm_config.structured_outputs_config.backend,
        adapters=AdapterRegistry(
            engine,
            catalog,
            settings,
            model_dir,
            Path(link.adapter_snapshots) if link else Path(scratch.name) / "adapters",
            shared_snapshots=link is not None,
        ),
        scratch=scratch,
        eos_token_ids=eos_token_ids(engine),
        scheduling_policy=engine.vllm_config.scheduler_config.policy,
        capacity=capacity,
        load=load,
    )
    logger.info(
        "engine ready: max_model_len=%d vocab_size=%d max_num_seqs=%d max_num_batched_tokens=%d"
        " max_num_queued_reqs=%d max_num_queued_tokens=%d adapters=%s base_adapter=%s",
        served.max_model_len,
        served.vocab_size,
        capacity.max_num_seqs,
        capacity.max_num_batched_tokens,
        capacity.max_num_queued_reqs,
        capacity.max_num_queued_tokens,
        ",".join(catalog.adapters) or "none",
        "all-zero (vLLM CPU LoRA fix)" if catalog.base_adapter else "none",
    )
    return served


async def abort_matching(engine: AsyncLLM, prefixes: list[str]) -> None:
    """Aborts the engine requests whose ids start with any of `prefixes` (running, queued or
    being added), and every request derived from them (parallel samples)."""
    if not prefixes:
        return
    # The engine's own table of the ids its callers gave (vLLM has no lookup by prefix).
    held = list(engine.output_processor.external_req_ids)
    matching = [request_id for request_id in held if request_id.startswith(tuple(prefixes))]
    if matching:
        await engine.abort(matching)
