"""The profile's py-spy summary attributes samples as docs/benchmarks/where-the-cpu-goes.md
reports them."""

from __future__ import annotations

from pathlib import Path

from bench.spy_summary import summarize_stacks

MAIN = "<module> (service/__main__.py:1)"
STACKS = "\n".join(
    [
        f"{MAIN};run (asyncio/runners.py:118);Handle._run (asyncio/events.py:78) 6",
        f"{MAIN};CompletionHandler.complete (service/api/completions.py:68)"
        ";StreamAssembler.chunk (service/api/responses.py:197) 3",
        "_bootstrap (threading.py:1002);prepare_prompts (service/api/prompts.py:99)"
        ";deepcopy (copy.py:128) 1",
    ]
)


def test_samples_count_for_their_innermost_frame_and_our_functions_inclusively(
    tmp_path: Path,
) -> None:
    collapsed = tmp_path / "stacks.txt"
    collapsed.write_text(STACKS)
    summary = summarize_stacks(collapsed)
    assert summary["samples"] == 10
    groups = dict(summary["groups"])
    assert groups["native code in event-loop callbacks (grpc aio's Cython core)"] == 0.6
    assert groups["our service (service/)"] == 0.3
    assert groups["copy.deepcopy (vLLM's tokenizer pool)"] == 0.1
    top = dict(summary["top"])
    assert top[MAIN] == 0.9
    assert top["prepare_prompts (service/api/prompts.py:99)"] == 0.1
