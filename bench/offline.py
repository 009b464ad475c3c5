"""The ceiling: offline LLM.generate on the same requests, in its own process.

Usage: python -m bench.offline MODEL_DIR INPUT_LEN OUTPUT_LEN NUM_PROMPTS CONCURRENCY RESULT_FILE

The engine runs at most CONCURRENCY sequences at once (max_num_seqs), as a server does under
a client that keeps that many requests in flight: the ceiling for that workload, not for a
larger batch the served workload never offers.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from bench.servers import ENGINE_ARGS

GIB = 1024**3


def main() -> None:
    model_dir, result_file = sys.argv[1], Path(sys.argv[6])
    input_len, output_len, num_prompts, concurrency = map(int, sys.argv[2:6])
    from vllm import LLM, SamplingParams
    from vllm.benchmarks.datasets import RandomDataset

    llm = LLM(
        model=model_dir,
        dtype=ENGINE_ARGS["dtype"],
        enforce_eager=True,
        max_model_len=ENGINE_ARGS["max_model_len"],
        kv_cache_memory_bytes=int(ENGINE_ARGS["kv_cache_gib"] * GIB),
        enable_prefix_caching=False,
        max_num_seqs=concurrency,
    )
    requests = RandomDataset(random_seed=0).sample(
        llm.get_tokenizer(), num_prompts, input_len=input_len, output_len=output_len
    )
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate([r.prompt for r in requests], params, use_tqdm=False)
    duration = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    result_file.write_text(
        json.dumps({"output_throughput": tokens / duration, "duration": duration})
    )


if __name__ == "__main__":
    main()
