"""A workaround for a vLLM engine bug: on the CPU build (0.32.0), a base-model request batched
with an adapter request gets an adapter applied.

vLLM's CPU LoRA ops (vllm/lora/ops/torch_ops/lora_ops.py) gather each token's adapter weights
with its slot index, and "no adapter" is the index -1, which Python indexing turns into the
last slot. (Upstream fixes, vllm-project/vllm#48421 and #49656, mask the gather; the GPU
kernels skip -1.) Here no request runs without an adapter: while adapters are served, base
model requests run with an all-zero adapter (a copy of the first adapter, every weight 0),
whose contribution is exactly nothing. It takes one more adapter slot (--max-loras + 1).

The workaround is on only where the bug is: on a CPU platform whose op, probed with the
index -1, picks up the last slot. tests/unit/test_adapters.py asserts the probe still finds
the bug, so the vLLM release that fixes it fails that test: then delete this module.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from vllm.platforms import current_platform

ADAPTER_CONFIG = "adapter_config.json"
SAFETENSORS_WEIGHTS = "adapter_model.safetensors"
BIN_WEIGHTS = "adapter_model.bin"
# Projections every vLLM model with LoRA support takes adapters on; the stand-in built from the
# model's own weights covers one of them (a slot's other modules are zero anyway).
PROJECTIONS = ("q_proj", "qkv_proj", "o_proj", "down_proj", "dense")


def lora_op_applies_last_slot_without_adapter() -> bool:
    """Whether vLLM's CPU LoRA op applies the last adapter slot to a token with no adapter."""
    from vllm.lora.ops.torch_ops import bgmv_shrink

    slots = torch.zeros(2, 1, 1, 2)  # two adapter slots of rank 1 over 2 features
    slots[-1] = 1.0  # only the last slot is non-zero
    output = torch.zeros(1, 1)
    bgmv_shrink(torch.ones(1, 2), slots, output, torch.tensor([-1]))
    return bool(output.abs().sum() > 0)


def needed() -> bool:
    """Whether base-model requests need the all-zero adapter on this engine build."""
    return current_platform.is_cpu() and lora_op_applies_last_slot_without_adapter()


def write_zero_adapter(source: Path, target: Path) -> Path:
    """A copy of the adapter in `source` with every weight zero, written to `target`."""
    target.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source / ADAPTER_CONFIG, target / ADAPTER_CONFIG)
    if (source / SAFETENSORS_WEIGHTS).is_file():
        weights = load_file(source / SAFETENSORS_WEIGHTS)
    else:
        weights = torch.load(source / BIN_WEIGHTS, map_location="cpu", weights_only=True)
    save_file(
        {name: torch.zeros_like(tensor) for name, tensor in weights.items()},
        target / SAFETENSORS_WEIGHTS,
    )
    return target


def write_model_zero_adapter(model_dir: Path, target: Path, rank: int) -> Path:
    """An all-zero adapter of `rank` on one projection of the model in `model_dir`, for when
    no adapter was given at start (adapters come at runtime), written to `target`."""
    module, (rows, columns) = first_projection(model_dir)
    target.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": rank,
        "target_modules": [module.rsplit(".", 1)[-1]],
        "bias": "none",
        "base_model_name_or_path": str(model_dir),
    }
    (target / ADAPTER_CONFIG).write_text(json.dumps(config))
    prefix = f"base_model.model.{module}"
    weights = {
        f"{prefix}.lora_A.weight": torch.zeros(rank, columns),
        f"{prefix}.lora_B.weight": torch.zeros(rows, rank),
    }
    save_file(weights, target / SAFETENSORS_WEIGHTS)
    return target


def first_projection(model_dir: Path) -> tuple[str, tuple[int, int]]:
    """The name of one projection layer of the model and its weight's shape (out, in)."""
    for weights in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(weights), framework="pt") as tensors:
            for key in tensors.keys():  # noqa: SIM118 (safe_open is no dict)
                name = key.removesuffix(".weight")
                if key.endswith(".weight") and name.rsplit(".", 1)[-1] in PROJECTIONS:
                    rows, columns = tensors.get_slice(key).get_shape()
                    return name, (rows, columns)
    raise FileNotFoundError(f"no projection weights ({', '.join(PROJECTIONS)}) in {model_dir}")
