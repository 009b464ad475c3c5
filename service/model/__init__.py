"""The model layer: vLLM's engine, the embedded default model, LoRA adapters, and the
engine processes' lifetime."""
