"""The README's calls, as a reader copies them, against a running stack: each command block of
its "Calling it" runs as written, with only the stack's ports and API key put in (the README
calls `make serve`'s default ports, without a key), and says what the README says it does.
tests/unit/test_readme_commands.py checks that every command of the README and docs/ names
only what exists; this runs the README's."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import API_KEY
from tests.processes import TestStack

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
CALLING = README.split("\n## Calling it\n", 1)[1].split("\n## ", 1)[0]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
BLOCKS = FENCE.findall(CALLING)
GRPCURL = shutil.which("grpcurl") or str(Path(sys.executable).parent / "grpcurl")
TIMEOUT = 120


def block(language: str, starting: str) -> str:
    (found,) = [text for lang, text in BLOCKS if lang == language and text.startswith(starting)]
    return found


def commands(script: str) -> list[str]:
    """A block's commands: each starts at the beginning of a line (its continuations, and the
    lines of a quoted JSON body, are indented)."""
    return [command.strip() for command in re.split(r"\n(?=\S)", script.strip()) if command]


def on_the_stack(command: str, base_url: str, grpc_target: str) -> str:
    """The command as it runs against the test stack: its ports, its key, this venv's grpcurl."""
    command = command.replace("http://127.0.0.1:8080", base_url)
    command = command.replace("127.0.0.1:50051", grpc_target)
    command = re.sub(r"^curl ", f"curl -H 'Authorization: Bearer {API_KEY}' ", command)
    return re.sub(
        r"^\.venv/bin/grpcurl ", f"{GRPCURL} -H 'authorization: Bearer {API_KEY}' ", command
    )


def run(command: str) -> str:
    done = subprocess.run(
        ["bash", "-c", command], capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT
    )
    assert done.returncode == 0, (command, done.stderr)
    return done.stdout


def test_the_readme_calls_every_surface() -> None:
    """The blocks this module runs are there (a rewrite of the README fails here first)."""
    assert [language for language, _ in BLOCKS] == ["sh", "python", "sh", "sh", "sh"]


def test_curl_completes_plainly_and_streamed(stack: TestStack) -> None:
    plain, streamed = commands(block("sh", "curl -s http://127.0.0.1:8080/v2/completions"))
    reply = json.loads(run(on_the_stack(plain, stack.base_url, stack.grpc_target)))
    assert reply["object"] == "text_completion"
    assert reply["choices"][0]["text"].startswith(" Paris")
    events = [
        line.removeprefix("data: ")
        for line in run(on_the_stack(streamed, stack.base_url, stack.grpc_target)).splitlines()
        if line.startswith("data: ")
    ]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    # Sampled (no temperature given): some text, then the usage chunk asked for.
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert chunks[-1]["choices"] == [] and 0 < chunks[-1]["usage"]["completion_tokens"] <= 8


def test_the_openai_sdk_completes_plainly_and_streamed(stack: TestStack) -> None:
    code = block("python", "from openai import OpenAI")
    code = code.replace("http://127.0.0.1:8080/v2", f"{stack.base_url}/v2")
    code = code.replace('api_key="unused"', f'api_key="{API_KEY}"')
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    first, _, story = done.stdout.partition("\n")
    assert first.startswith(" Paris")
    assert len(story.strip()) > 0


def test_grpcurl_lists_and_completes(stack: TestStack) -> None:
    listing, call = commands(block("sh", ".venv/bin/grpcurl"))
    assert (
        "llmcompletions.v2.CompletionService"
        in run(on_the_stack(listing, stack.base_url, stack.grpc_target)).split()
    )
    output = run(on_the_stack(call, stack.base_url, stack.grpc_target))
    messages = [json.loads(m) for m in output.replace("}\n{", "}\n\x00{").split("\x00")]
    assert len(messages) > 1  # streamed, and sampled (no temperature given)
    # A sampled token may end a chunk with no text yet (part of a character): grpcurl then
    # prints no `text` field at all.
    assert "".join(m["choices"][0].get("text", "") for m in messages)


def test_curl_chats(stack: TestStack) -> None:
    (chat,) = commands(block("sh", "curl -s http://127.0.0.1:8080/v2/chat"))
    reply = json.loads(run(on_the_stack(chat, stack.base_url, stack.grpc_target)))
    assert reply["object"] == "chat.completion"
    assert "Paris" in reply["choices"][0]["message"]["content"]


def test_curl_creates_a_batch_job_that_completes(stack: TestStack, batch_root: Path) -> None:
    (create,) = commands(block("sh", "curl -s http://127.0.0.1:8080/v2/batch-completions"))
    job = json.loads(run(on_the_stack(create, stack.base_url, stack.grpc_target)))
    assert job["status"] in ("queued", "running")
    deadline = time.monotonic() + TIMEOUT
    while job["status"] not in ("completed", "failed") and time.monotonic() < deadline:
        time.sleep(0.5)
        read = f"curl -s http://127.0.0.1:8080/v2/batch-completions/{job['job_id']}"
        job = json.loads(run(on_the_stack(read, stack.base_url, stack.grpc_target)))["job"]
    assert job["status"] == "completed"
    (answer,) = json.loads((batch_root / job["output_data_path"]).read_text())
    assert answer["choices"][0]["text"].startswith(" Paris")


def test_a_command_gets_the_stacks_ports_and_key() -> None:
    ports = ("http://127.0.0.1:1234", "127.0.0.1:5678")
    rest = on_the_stack("curl -s http://127.0.0.1:8080/v2/models", *ports)
    assert rest == f"curl -H 'Authorization: Bearer {API_KEY}' -s http://127.0.0.1:1234/v2/models"
    grpc = on_the_stack(".venv/bin/grpcurl -plaintext 127.0.0.1:50051 list", *ports)
    assert grpc == f"{GRPCURL} -H 'authorization: Bearer {API_KEY}' -plaintext 127.0.0.1:5678 list"
