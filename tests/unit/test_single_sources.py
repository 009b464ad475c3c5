"""Facts stated once: numeric ranges in the proto (feeding validation, the OpenAPI document and
the field table of docs/calling/fields.md), the version in pyproject.toml."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import service
from service.api.declared_ranges import DECLARED_RANGES
from service.api.validation import describe_range

ROOT = Path(__file__).resolve().parents[2]
FIELDS_PAGE = (ROOT / "docs" / "calling" / "fields.md").read_text()
OPENAPI = json.loads((ROOT / "facade" / "openapi.json").read_text())
REQUEST_SCHEMA = OPENAPI["components"]["schemas"]["CreateCompletionRequest"]["properties"]


def documented_limits(field: str) -> str:
    """The 'limits, default' cell of the field's row in the request-field table of
    docs/calling/fields.md."""
    for line in FIELDS_PAGE.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 4 and f"`{field}`" in cells[0].split(", "):
            return cells[2]
    raise AssertionError(f"no row for {field} in docs/calling/fields.md")


@pytest.mark.parametrize("field", sorted(DECLARED_RANGES))
def test_the_field_table_states_each_declared_range(field: str) -> None:
    assert describe_range(*DECLARED_RANGES[field]).removeprefix("in ") in documented_limits(field)


@pytest.mark.parametrize("field", sorted(DECLARED_RANGES))
def test_the_openapi_document_states_each_declared_range(field: str) -> None:
    schema = REQUEST_SCHEMA[field]
    schema = schema.get("additionalProperties", schema)  # a map: the range of its values
    low, high = DECLARED_RANGES[field]
    if low is not None:
        assert schema["minimum" if low.inclusive else "exclusiveMinimum"] == low.value
    if high is not None:
        assert schema["maximum" if high.inclusive else "exclusiveMaximum"] == high.value
    assert (low, high) != (None, None) or not {"minimum", "maximum"} & set(schema)


def test_every_numeric_request_field_has_a_declared_range() -> None:
    numeric = {
        name
        for name, schema in REQUEST_SCHEMA.items()
        if "number" in str(schema.get("type"))
        # seed and priority take any value of their type
        or ("integer" in str(schema.get("type")) and name not in ("seed", "priority"))
    }
    assert numeric <= set(DECLARED_RANGES)


def test_the_version_is_pyprojects() -> None:
    declared = re.search(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.M)
    assert declared is not None
    assert service.__version__ == declared.group(1)


def test_the_client_distribution_has_the_servers_version_and_the_server_pins_it() -> None:
    client = (ROOT / "clients" / "python" / "pyproject.toml").read_text()
    declared = re.search(r'^version = "(.+)"$', client, re.M)
    assert declared is not None and declared.group(1) == service.__version__
    server = (ROOT / "pyproject.toml").read_text()
    assert f'"llm-completions-client=={service.__version__}"' in server
