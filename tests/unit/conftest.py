"""The unit layer: pure functions and classes, no engine, no Envoy, no model files.

`make unit` runs this directory with `--confcutdir=tests/unit`, so tests/conftest.py (whose
session fixtures start the engine and Envoy) is not even loaded. When the unit tests are
collected together with the rest (`pytest tests`), the hook below refuses any unit test that
would pull in those fixtures, directly or through another fixture.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from unit_fakes import FakeTokenizer

UNIT_DIR = Path(__file__).parent
# Fixtures of tests/conftest.py that start the stack or prepare the real model.
HEAVY_FIXTURES = frozenset(
    {
        "stack",
        "rest",
        "grpc_stub",
        "openai_client",
        "metrics_url",
        "model_dir",
        "tokenizer",
        "vllm_server",
    }
)


def pytest_configure(config: pytest.Config) -> None:
    # Importing vLLM imports torch, which warns about its own internals; not ours to fix.
    config.addinivalue_line(
        "filterwarnings", "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if UNIT_DIR not in Path(str(item.path)).parents:
            continue
        heavy = HEAVY_FIXTURES.intersection(getattr(item, "fixturenames", ()))
        if heavy:
            raise pytest.UsageError(
                f"{item.nodeid} uses {sorted(heavy)}: unit tests must not start the stack"
            )


@pytest.fixture
def fake_tokenizer() -> FakeTokenizer:
    # Imported here, not at the top: unit_fakes imports vLLM, and conftest modules load before
    # pytest_configure has added the warning filter above.
    from unit_fakes import FakeTokenizer

    return FakeTokenizer()
