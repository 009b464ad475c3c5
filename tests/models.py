"""Model directories the tests serve besides the default model: small LoRA adapters made in
seconds, and a variant of the default model whose tokenizer adds a BOS token."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

# lora_B scaled by this: greedy output changes from the first token yet stays text (5 was noise).
B_SCALE = 2.0
BOS_ID = 0
# The modules the test adapters change; the engines serving them give LoRA layers to these only
# (--lora-target-modules), which makes every step of theirs cheaper.
ADAPTER_MODULES = ("q_proj", "v_proj")
ADAPTER_TARGETS = ("--lora-target-modules", ",".join(ADAPTER_MODULES))


def build_adapter(
    model_dir: Path,
    target: Path,
    seed: int,
    rank: int = 8,
    modules: tuple[str, ...] = ADAPTER_MODULES,
) -> Path:
    """A PEFT LoRA adapter on the model, changing `modules`: seeded random weights, lora_B
    scaled by B_SCALE."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(
        r=rank, lora_alpha=16, target_modules=list(modules), init_lora_weights=False
    )
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.mul_(B_SCALE)
    peft_model.save_pretrained(target)
    return target


def with_bos_tokenizer(model_dir: Path, target: Path) -> Path:
    """The model's files linked into `target`, with a tokenizer that prepends <|endoftext|>
    (the default model's adds no special tokens)."""
    target.mkdir()
    for item in model_dir.iterdir():
        if item.name != "tokenizer.json":
            os.symlink(item, target / item.name)
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {
            "<|endoftext|>": {"id": "<|endoftext|>", "ids": [BOS_ID], "tokens": ["<|endoftext|>"]}
        },
    }
    (target / "tokenizer.json").write_text(json.dumps(tokenizer))
    return target
