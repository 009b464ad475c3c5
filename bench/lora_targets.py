"""What --lora-target-modules saves on a replica that serves adapters (vLLM's CPU build): two
replicas of the embedded model with `make serve`'s settings, each on a core of its own, each
serving the same adapter (rank 8 on q_proj and v_proj, as PEFT's default for Llama models
makes them). One gives every module the model supports a LoRA layer (the default), the other
only the adapter's (`--lora-target-modules q_proj,v_proj`). The same calls go to each in turn,
one at a time, base-model calls (which run through the all-zero stand-in adapter on the CPU
build) and the adapter's. Reports each replica's median latency and their ratio, measured in
the same run.

Usage: python -m bench.lora_targets [--rounds 3] [--calls 5] [--swap-cores]   (about 3 minutes)
"""

from __future__ import annotations

import argparse
import tempfile
from contextlib import ExitStack
from pathlib import Path

from bench.adapter_root_cost import CALLS, median_latency, replica
from service.model.default_model import prepare_default_model
from tests.models import ADAPTER_MODULES, ADAPTER_TARGETS, build_adapter

ADAPTER = "sql"


def calls() -> dict[str, dict[str, object]]:
    """Each base-model call of bench.adapter_root_cost, and the same through the adapter."""
    base = {f"base, {name}": fields for name, fields in CALLS.items()}
    adapter = {f"adapter, {name}": {**fields, "model": ADAPTER} for name, fields in CALLS.items()}
    return {**base, **adapter}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument(
        "--swap-cores", action="store_true", help="the targeted replica on core 0, not 1"
    )
    args = parser.parse_args()
    every_core, targeted_core = (1, 0) if args.swap_cores else (0, 1)
    with ExitStack() as stack:
        scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="lora-targets-")))
        adapter = build_adapter(prepare_default_model(), scratch / ADAPTER, seed=1)
        serving = ["--lora-modules", f"{ADAPTER}={adapter}"]
        every = stack.enter_context(replica(every_core, serving))
        targeted = stack.enter_context(replica(targeted_core, [*serving, *ADAPTER_TARGETS]))
        print(f"| call | round | every module (s) | {'+'.join(ADAPTER_MODULES)} only (s) | ratio |")
        print("|---|---|---|---|---|")
        for number in range(1, args.rounds + 1):
            for name, fields in calls().items():
                wide = median_latency(every, fields, args.calls)
                only = median_latency(targeted, fields, args.calls)
                print(f"| {name} | {number} | {wide:.3f} | {only:.3f} | {only / wide:.2f}x |")


if __name__ == "__main__":
    main()
