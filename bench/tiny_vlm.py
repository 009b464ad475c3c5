"""A tiny random-weight vision-language model: Idefics3 (SmolVLM's architecture).

Image requests exercise a path text requests never reach (fetching and decoding images, the
processor's tiling, placeholder tokens, the vision encoder), and a real VLM on a CPU host is far
too slow and large to test that path. With one narrow layer on each side and 32-pixel tiles the
engine is cheap; the text side reuses the default model's tokenizer, so nothing is downloaded.
Built once in seconds, cached beside the default model.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from bench.tiny_model import HIDDEN_SIZE, NUM_LAYERS, SEED, built_once
from bench.tiny_model import tiny_settings as text_settings
from service.model.default_model import prepare_default_model

# The text model is bench/tiny_model.py's narrow Llama layer (its settings).
# The vision model: one layer over 32-pixel tiles of 8-pixel patches (16 patches), which the
# pixel shuffle (scale factor 2) folds into 4 image tokens per tile.
VISION_HIDDEN_SIZE = 32
VISION_INTERMEDIATE_SIZE = 128
VISION_LAYERS = 1
VISION_HEADS = 1
IMAGE_SIZE = 32
PATCH_SIZE = 8
SCALE_FACTOR = 2
IMAGE_SEQ_LEN = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2
# An image is first resized so its longest edge is this, then cut into IMAGE_SIZE tiles (plus
# one global tile): at most 2x2 + 1 tiles, so at most 20 image tokens.
RESIZED_LONGEST_EDGE = 2 * IMAGE_SIZE
COMPLETE_MARKER = "tiny_vlm.json"

IMAGE_TOKEN = "<image>"
END_OF_UTTERANCE = "<end_of_utterance>"
# Idefics3's tokens, absent from SmolLM2's tokenizer; the processor looks all of them up.
ADDED_TOKENS = (
    "<fake_token_around_image>",
    IMAGE_TOKEN,
    END_OF_UTTERANCE,
    "<global-img>",
    *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)),
)
# SmolVLM's chat template, also taking string content (vLLM's "string" content format, where
# the image placeholder "<image>" is already in the text) and unconverted image_url parts.
CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}{{ ': ' + message['content'] }}"
    "{% else %}"
    "{% if message['content'] and message['content'][0]['type'] in ['image', 'image_url'] %}"
    "{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ['image', 'image_url'] %}{{ '<image>' }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def vision_settings() -> dict[str, object]:
    return {
        "hidden_size": VISION_HIDDEN_SIZE,
        "intermediate_size": VISION_INTERMEDIATE_SIZE,
        "num_hidden_layers": VISION_LAYERS,
        "num_attention_heads": VISION_HEADS,
        "image_size": IMAGE_SIZE,
        "patch_size": PATCH_SIZE,
    }


def tiny_settings() -> dict[str, object]:
    """What the marker records: a change to any of these is a new model."""
    return {
        "text": text_settings(),
        "vision": vision_settings(),
        "scale_factor": SCALE_FACTOR,
        "resized_longest_edge": RESIZED_LONGEST_EDGE,
    }


def tiny_vlm_dir(default_dir: Path) -> Path:
    name = (
        f"{default_dir.name}-idefics3-random-l{NUM_LAYERS}-h{HIDDEN_SIZE}"
        f"-v{VISION_HIDDEN_SIZE}-img{IMAGE_SIZE}p{PATCH_SIZE}-s{SEED}"
    )
    return default_dir.parent / name


def prepare_tiny_vlm() -> Path:
    """Return the tiny VLM's directory, building it first if it is missing."""
    default_dir = prepare_default_model()
    return built_once(default_dir, tiny_vlm_dir(default_dir), COMPLETE_MARKER, build)


def load_tokenizer(default_dir: Path) -> Any:
    """The default model's tokenizer with Idefics3's tokens, and a template that knows images."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": list(ADDED_TOKENS)})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def text_config(default_dir: Path, vocab_size: int) -> Any:
    """The default model's Llama config, narrowed, its vocabulary grown by the added tokens."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(default_dir)
    for key, value in text_settings().items():
        setattr(config, key, value)
    config.vocab_size = vocab_size
    return config


def vlm_config(default_dir: Path, tokenizer: Any) -> Any:
    """Idefics3's config; its token ids must be this tokenizer's (its defaults are Llama 3's)."""
    from transformers import Idefics3Config, Idefics3VisionConfig

    text = text_config(default_dir, len(tokenizer))
    vision = Idefics3VisionConfig(**vision_settings())
    return Idefics3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        scale_factor=SCALE_FACTOR,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        pad_token_id=tokenizer.pad_token_id,
        # Tied like SmolLM2's: one embedding matrix, so the checkpoint stays small.
        tie_word_embeddings=text.tie_word_embeddings,
    )


def make_processor(tokenizer: Any) -> Any:
    """Idefics3's processor with the PIL image processor (no torchvision here), small tiles."""
    from transformers import Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )

    image_processor = Idefics3ImageProcessorPil(
        size={"longest_edge": RESIZED_LONGEST_EDGE},
        max_image_size={"longest_edge": IMAGE_SIZE},
    )
    return Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_len=IMAGE_SEQ_LEN,
        chat_template=CHAT_TEMPLATE,
    )


def generation_config(tokenizer: Any) -> Any:
    """Stop at SmolVLM's end of turn, or at SmolLM2's."""
    from transformers import GenerationConfig

    return GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.convert_tokens_to_ids(END_OF_UTTERANCE), tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
    )


def build(default_dir: Path, target: Path) -> None:
    """Seeded random float32 weights saved with the processor and tokenizer, atomically."""
    import torch
    from transformers import Idefics3ForConditionalGeneration
    from transformers.utils import logging as transformers_logging

    print(f"tiny vlm: building {target.name} from {default_dir.name}'s tokenizer", flush=True)
    transformers_logging.disable_progress_bar()  # the line above is the progress shown
    tokenizer = load_tokenizer(default_dir)
    config = vlm_config(default_dir, tokenizer)
    torch.manual_seed(SEED)
    model = Idefics3ForConditionalGeneration._from_config(config, dtype=torch.float32)
    model.generation_config = generation_config(tokenizer)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".tiny-vlm-") as scratch:
        work = Path(scratch) / "model"
        model.save_pretrained(work, safe_serialization=True)
        make_processor(tokenizer).save_pretrained(work)
        (work / COMPLETE_MARKER).write_text(json.dumps({**tiny_settings(), "seed": SEED}))
        if target.exists():
            shutil.rmtree(target)
        work.rename(target)


if __name__ == "__main__":
    print(prepare_tiny_vlm())
