"""LoRA adapters by name on the real engine: each adapter's output equals vLLM's own OpenAI
server with the same adapters, differs from the base model's, and stays its own in a batch
mixed with the base model and other adapters; bad adapters stop the server at start-up.

Both servers here run without chat flags, so chat through an adapter and the tool choices
that need `--tool-call-parser` are checked here too."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from service.model import cpu_lora_fix
from tests.conftest import ADAPTER_SEEDS, LORA_MODEL, SMALL_ENGINE
from tests.helpers import CAPITAL_PROMPT
from tests.metrics import scrape
from tests.models import build_adapter
from tests.processes import TestStack, free_port
from tests.test_vllm_parity import assert_logprobs_close

ADAPTERS = tuple(ADAPTER_SEEDS)
PROMPTS = [CAPITAL_PROMPT, "def fibonacci(n):", "Once upon a time, in a small village,"]
# A hang guard, not a speed bound: three refused starts import vLLM side by side while the
# adapter engines serve, which took over 90 s on a busy 2-core CI host. That no engine started
# is read from the output instead.
STARTUP_FAILURE_SECONDS = 300


@pytest.fixture(scope="module")
def rest(lora_stack: TestStack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=lora_stack.base_url, timeout=120) as client:
        yield client


def completion(rest: httpx.Client, model: str, **fields: Any) -> dict[str, Any]:
    payload = {"model": model, "temperature": 0, "max_tokens": 24, **fields}
    response = rest.post("/v2/completions", json=payload)
    assert response.status_code == 200, response.text
    return response.json()


def text(reply: dict[str, Any]) -> str:
    return reply["choices"][0]["text"]


@pytest.fixture(scope="module")
def base_texts(rest: httpx.Client) -> dict[str, str]:
    """The base model's greedy text for each prompt, made once for both adapters."""
    return {prompt: text(completion(rest, LORA_MODEL, prompt=prompt)) for prompt in PROMPTS}


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("adapter", ADAPTERS)
def test_adapter_greedy_text_and_logprobs_equal_vllm_and_differ_from_base(
    rest: httpx.Client,
    vllm_lora_server: str,
    base_texts: dict[str, str],
    adapter: str,
    prompt: str,
) -> None:
    request = {"model": adapter, "prompt": prompt, "max_tokens": 24, "temperature": 0}
    request["logprobs"] = 3
    # Each server computes its reply alone (a reply's numbers can depend on its batch); the
    # two servers run on cores of their own, side by side.
    with ThreadPoolExecutor(1) as pool:
        asked = pool.submit(
            httpx.post, f"{vllm_lora_server}/v1/completions", json=request, timeout=120
        )
        ours = completion(rest, **request)
        theirs = asked.result().json()
    assert ours["model"] == adapter
    assert text(ours) == text(theirs)
    assert_logprobs_close(ours["choices"][0]["logprobs"], theirs["choices"][0]["logprobs"])
    assert text(ours) != base_texts[prompt]


def chat(url: str, model: str, **fields: Any) -> httpx.Response:
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    payload = {"model": model, "messages": messages, "temperature": 0, **fields}
    return httpx.post(url, json=payload, timeout=120)


def test_adapter_chat_equals_vllm_and_differs_from_base(
    rest: httpx.Client, vllm_lora_server: str
) -> None:
    ours = chat(f"{rest.base_url}/v2/chat/completions", "a1", max_completion_tokens=16).json()
    theirs = chat(f"{vllm_lora_server}/v1/chat/completions", "a1", max_completion_tokens=16).json()
    base = chat(f"{rest.base_url}/v2/chat/completions", LORA_MODEL, max_completion_tokens=16).json()
    content = ours["choices"][0]["message"]["content"]
    assert ours["model"] == "a1"
    assert content == theirs["choices"][0]["message"]["content"]
    assert content != base["choices"][0]["message"]["content"]


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    "tool_choice", ["auto", "required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_tool_choices_needing_a_parser_are_refused_as_vllm_refuses_them(
    rest: httpx.Client, vllm_lora_server: str, tool_choice: Any
) -> None:
    fields = {"tools": [TOOL], "tool_choice": tool_choice, "max_completion_tokens": 8}
    ours = chat(f"{rest.base_url}/v2/chat/completions", LORA_MODEL, **fields)
    theirs = chat(f"{vllm_lora_server}/v1/chat/completions", LORA_MODEL, **fields)
    assert theirs.status_code == 400  # vLLM's own server refuses it too
    assert ours.status_code == 422, ours.text
    (violation,) = ours.json()["detail"]
    assert "--tool-call-parser" in violation["msg"]
    if tool_choice == "auto":
        assert "--enable-auto-tool-choice" in violation["msg"]


def test_adapter_echo_logprobs_equal_vllm(rest: httpx.Client, vllm_lora_server: str) -> None:
    request = {"model": "a1", "prompt": CAPITAL_PROMPT, "max_tokens": 8, "temperature": 0}
    request.update(logprobs=2, echo=True)
    theirs = httpx.post(f"{vllm_lora_server}/v1/completions", json=request, timeout=120).json()
    ours = completion(rest, **request)
    assert text(ours) == text(theirs)
    assert_logprobs_close(ours["choices"][0]["logprobs"], theirs["choices"][0]["logprobs"])


def test_base_and_adapters_batched_together_each_get_their_own_output(
    rest: httpx.Client,
) -> None:
    """The CPU engine bug (service/model/cpu_lora_fix.py): without the fix, the base model's
    requests in a batch with adapter requests come back with an adapter's text."""
    models = [LORA_MODEL, *ADAPTERS]
    alone = {model: completion(rest, model, prompt=CAPITAL_PROMPT, logprobs=1) for model in models}
    assert len({text(reply) for reply in alone.values()}) == len(models)
    mixed = [model for _ in range(3) for model in models]
    with ThreadPoolExecutor(len(mixed)) as pool:
        together = list(
            pool.map(lambda m: completion(rest, m, prompt=CAPITAL_PROMPT, logprobs=1), mixed)
        )
    for model, reply in zip(mixed, together, strict=True):
        assert text(reply) == text(alone[model]), model
        assert_logprobs_close(
            reply["choices"][0]["logprobs"], alone[model]["choices"][0]["logprobs"]
        )


def streamed_text(rest: httpx.Client, model: str, **fields: Any) -> str:
    payload = {"model": model, "temperature": 0, "max_tokens": 24, "stream": True, **fields}
    pieces = []
    with rest.stream("POST", "/v2/completions", json=payload) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                pieces += [choice["text"] for choice in json.loads(line[6:])["choices"]]
    return "".join(pieces)


def test_streaming_with_an_adapter_equals_the_whole_reply(rest: httpx.Client) -> None:
    whole = text(completion(rest, "a2", prompt=PROMPTS[2]))
    assert streamed_text(rest, "a2", prompt=PROMPTS[2]) == whole


@pytest.mark.parametrize(
    "fields",
    [
        {"use_beam_search": True, "n": 2, "best_of": 2, "max_tokens": 8},
        {"n": 2, "best_of": 3, "temperature": 0.8, "seed": 7},
        {"guided_regex": "[A-Z][a-z]+"},
        {"guided_choice": ["yes", "no", "maybe"]},
        {"echo": True, "max_tokens": 0},
    ],
)
def test_fields_work_with_an_adapter_and_follow_it(rest: httpx.Client, fields: dict) -> None:
    """Each field gives a well-formed reply with an adapter; run twice (seeded or greedy) it
    gives the same, and the adapter's differs from the base model's where outputs can."""
    first = completion(rest, "a1", prompt=CAPITAL_PROMPT, **fields)
    again = completion(rest, "a1", prompt=CAPITAL_PROMPT, **fields)
    assert [c["text"] for c in first["choices"]] == [c["text"] for c in again["choices"]]
    if "guided_choice" in fields:
        assert text(first) in fields["guided_choice"]
    if fields.get("use_beam_search"):
        base = completion(rest, LORA_MODEL, prompt=CAPITAL_PROMPT, **fields)
        assert [c["text"] for c in first["choices"]] != [c["text"] for c in base["choices"]]


def test_an_unknown_model_is_404_listing_the_served_names(rest: httpx.Client) -> None:
    response = rest.post("/v2/completions", json={"model": "a3", "prompt": "Hi"})
    assert response.status_code == 404
    message = response.text
    for name in (LORA_MODEL, *ADAPTERS):
        assert f"`{name}`" in message


# ---- start-up failures: no engine is started, the process exits with one line


def serve_and_fail(*flags: str) -> tuple[int, str]:
    command = [sys.executable, "-m", "service", "serve", "--port", str(free_port())]
    finished = subprocess.run(
        [*command, *SMALL_ENGINE, "--metrics-port", str(free_port()), *flags],
        capture_output=True,
        text=True,
        timeout=STARTUP_FAILURE_SECONDS,
    )
    return finished.returncode, finished.stderr


def error_lines(stderr: str) -> list[str]:
    """The service's error lines; the last line of its output must be one."""
    lines = stderr.splitlines()
    assert lines and lines[-1].startswith("llm-completions: error:"), stderr
    return [line for line in lines if line.startswith("llm-completions: error:")]


def foreign_adapter(adapter: Path, target: Path) -> Path:
    """The adapter's weights, declared as trained on another base model."""
    target.mkdir()
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "meta-llama/Llama-3.2-1B"
    (target / "adapter_config.json").write_text(json.dumps(config))
    (target / "adapter_model.safetensors").write_bytes(
        (adapter / "adapter_model.safetensors").read_bytes()
    )
    return target


@pytest.fixture(scope="module")
def refused_starts(
    model_dir: Path, adapter_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[int, str]]:
    """Servers given a bad adapter, started side by side: each one's exit code and
    stderr."""
    root = tmp_path_factory.mktemp("refused")
    wide = build_adapter(model_dir, root / "wide", seed=3, rank=16)
    flags = {
        "broken": ("--lora-modules", f"broken={root / 'missing'}"),
        "wide": ("--lora-modules", f"wide={wide}", "--max-lora-rank", "8"),
        "other": ("--lora-modules", f"other={foreign_adapter(adapter_dirs['a1'], root / 'other')}"),
    }
    with ThreadPoolExecutor(len(flags)) as pool:
        ended = pool.map(lambda given: serve_and_fail(*given), flags.values())
        return dict(zip(flags, ended, strict=True))


def test_a_bad_adapter_path_fails_start_up_naming_it(
    refused_starts: dict[str, tuple[int, str]],
) -> None:
    code, stderr = refused_starts["broken"]
    assert code != 0
    assert len(error_lines(stderr)) == 1, stderr
    assert "`broken`" in error_lines(stderr)[0]
    assert "engine" not in stderr.lower()


def test_an_adapter_over_max_lora_rank_fails_start_up_naming_it(
    refused_starts: dict[str, tuple[int, str]],
) -> None:
    code, stderr = refused_starts["wide"]
    assert code != 0
    [line] = error_lines(stderr)
    assert "`wide`" in line and "16" in line and "--max-lora-rank 8" in line


def test_an_adapter_of_another_base_model_fails_start_up_naming_it(
    refused_starts: dict[str, tuple[int, str]],
) -> None:
    code, stderr = refused_starts["other"]
    assert code != 0
    [line] = error_lines(stderr)
    assert "`other`" in line and "Llama-3.2-1B" in line


def test_adapters_are_listed_with_their_base_model_as_parent(
    rest: httpx.Client, lora_stack: TestStack
) -> None:
    client = openai.OpenAI(base_url=f"{lora_stack.base_url}/v2", api_key="unused")
    listed = {model.id: model for model in client.models.list()}
    assert list(listed) == [LORA_MODEL, *ADAPTERS]
    assert listed[LORA_MODEL].parent is None  # type: ignore[attr-defined]
    assert all(listed[name].parent == LORA_MODEL for name in ADAPTERS)  # type: ignore[attr-defined]
    assert client.models.retrieve("a1").id == "a1"
    info = rest.get(f"/v2/models/{LORA_MODEL}").json()
    assert info["adapters"] == list(ADAPTERS)
    assert rest.get("/v2/models/a2").json()["parent"] == LORA_MODEL


def test_an_adapter_tokenizes_as_its_base_model(rest: httpx.Client) -> None:
    counts = [
        rest.post("/v2/tokenize", json={"model": name, "prompt": CAPITAL_PROMPT}).json()["count"]
        for name in (LORA_MODEL, *ADAPTERS)
    ]
    assert (
        counts[0]
        == completion(rest, "a1", prompt=CAPITAL_PROMPT, max_tokens=1)["usage"]["prompt_tokens"]
    )
    assert len(set(counts)) == 1


# ---- what an endpoint picker's LoRA affinity scorer reads


def latest_lora_info(metrics_url: str) -> dict[str, str]:
    """The labels of vllm:lora_requests_info's newest series: vLLM starts a series for each
    combination of running and waiting adapters and sets it to the time it last held, so a
    picker reads the one with the highest value (as the Gateway API Inference Extension's
    does)."""
    found = [
        (v, dict(labels))
        for (n, labels), v in scrape(metrics_url).items()
        if n == "vllm:lora_requests_info"
    ]
    assert found, f"{metrics_url} publishes no vllm:lora_requests_info"
    return max(found, key=lambda series: series[0])[1]


def adapters(listed: str) -> set[str]:
    return {name.strip() for name in listed.split(",") if name.strip()}


def test_lora_requests_info_names_the_running_adapters_and_the_slots(
    rest: httpx.Client, lora_stack: TestStack
) -> None:
    """vllm:lora_requests_info as vLLM publishes it: `running_lora_adapters` names the adapter
    of a request being generated, both lists are empty once it has finished, and `max_lora` is
    the engine's adapter slots: --max-loras, plus the one the base model's stand-in takes
    where the CPU LoRA workaround is on (service/model/cpu_lora_fix.py)."""
    args = lora_stack.service_args
    metrics_url = lora_stack.metrics_url
    max_loras = int(args[args.index("--max-loras") + 1])
    payload = {"model": "a1", "prompt": CAPITAL_PROMPT, "max_tokens": 64, "ignore_eos": True}
    during: dict[str, str] = {}
    with rest.stream("POST", "/v2/completions", json={**payload, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        events = 0
        for line in response.iter_lines():
            events += line.startswith("data: ")
            if events == 3:
                during = latest_lora_info(metrics_url)
    assert set(during) == {"running_lora_adapters", "waiting_lora_adapters", "max_lora"}
    assert "a1" in adapters(during["running_lora_adapters"]), during
    assert during["max_lora"] == str(max_loras + int(cpu_lora_fix.needed()))

    deadline = time.monotonic() + 5
    while adapters(latest_lora_info(metrics_url)["running_lora_adapters"]):
        assert time.monotonic() < deadline, latest_lora_info(metrics_url)
        time.sleep(0.1)
    after = latest_lora_info(metrics_url)
    assert after["waiting_lora_adapters"] == ""
    assert after["max_lora"] == during["max_lora"]
