"""The real-process suite's engine start-ups stay counted and bounded (tests/engines.py): every
engine a test module starts names its configuration, no configuration is built twice under two
names (a module that needs one already shared uses the shared one), vLLM's own server is
started only as a shared engine, and the whole budget stays within the ceiling below, which a
new start-up has to raise on purpose. The session itself counts what it starts and fails past
a configuration's budget (tests/conftest.py)."""

from __future__ import annotations

import ast
import functools
from collections import defaultdict
from pathlib import Path

from tests.conftest import SHARED_FIXTURES, SHARED_GROUPS
from tests.engines import START_BUDGET
from tests.shards import (
    FLEET_MODULES,
    SHARD_ENGINES,
    may_start,
    overall_exit,
    real_modules,
    shard_modules,
)

TESTS = Path(__file__).resolve().parents[1]
# Every start-up of a whole run; each costs about 50 s on a 2-core host (the tiny VLM's two,
# for images, about 35 s each).
MAX_START_UPS = 33
HARNESS = ("processes.py", "engines.py")


@functools.cache
def modules() -> dict[str, ast.Module]:
    return {
        path.name: ast.parse(path.read_text(), str(path))
        for path in sorted(TESTS.glob("*.py"))
        if path.name not in HARNESS
    }


def calls_of(tree: ast.Module, name: str) -> list[ast.Call]:
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and (getattr(node.func, "id", None) or getattr(node.func, "attr", None)) == name
    ]


def keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def engine_stacks() -> list[tuple[str, int, ast.expr | None, ast.expr]]:
    """Every engine a module builds: (module, line, its engine= name, its service arguments).
    A TestStack without service arguments is an Envoy-only handle; conftest.py's shared
    engines are built through `on_free_ports(name, service_args, ...)` and
    `pinned_replica(name, core, log, service_args)`, whose own TestStack forwards the name it
    is given."""
    found = []
    for module, tree in modules().items():
        for call in calls_of(tree, "TestStack"):
            args, engine = keyword(call, "service_args"), keyword(call, "engine")
            forwarded = module == "conftest.py" and isinstance(engine, ast.Name)
            if args is not None and not forwarded:
                found.append((module, call.lineno, engine, args))
        for call in calls_of(tree, "on_free_ports"):
            found.append((module, call.lineno, call.args[0], call.args[1]))
        for call in calls_of(tree, "pinned_replica"):
            assert isinstance(call.args[3], ast.List), f"{module}:{call.lineno}: list its args"
            found.append((module, call.lineno, call.args[0], call.args[3]))
    return found


def test_every_engine_a_test_starts_names_a_declared_configuration() -> None:
    unnamed = [
        f"{module}:{line}"
        for module, line, engine, _ in engine_stacks()
        if not (isinstance(engine, ast.Constant) and engine.value in START_BUDGET)
    ]
    assert not unnamed, f"an engine without a declared name (tests/engines.py): {unnamed}"


def test_no_configuration_is_built_twice_under_two_names() -> None:
    names_by_args: dict[str, set[str]] = defaultdict(set)
    for _, _, engine, args in engine_stacks():
        assert isinstance(engine, ast.Constant)
        names_by_args[ast.dump(args)].add(str(engine.value))
    twice = [names for names in names_by_args.values() if len(names) > 1]
    assert not twice, f"the same engine under several names; share one instead: {twice}"


def test_vllms_own_server_starts_only_as_a_shared_engine() -> None:
    starting = [
        f"{module}:{call.lineno}"
        for module, tree in modules().items()
        for call in calls_of(tree, "VllmOpenAIServer")
        if module != "conftest.py"
    ]
    assert not starting, (
        f"start vLLM's server through tests/conftest.py's shared engines: {starting}"
    )


def test_the_whole_runs_start_ups_stay_within_the_ceiling() -> None:
    assert all(budget >= 1 for budget in START_BUDGET.values())
    assert sum(START_BUDGET.values()) <= MAX_START_UPS


def test_each_shared_engine_belongs_to_exactly_one_shard() -> None:
    """Sharded runs (tests/shards.py) start each shared engine once: in the shard that owns
    it, which holds every module that uses it."""
    owners = [engine for engines in SHARD_ENGINES.values() for engine in engines]
    assert sorted(owners) == sorted(set(SHARED_FIXTURES.values()))
    for group in SHARED_GROUPS:
        assert sum(bool(group & engines) for engines in SHARD_ENGINES.values()) == 1, group
    for shard, engines in SHARD_ENGINES.items():
        assert all(may_start(shard, engine) == (engine in engines) for engine in owners)


def test_every_real_process_module_runs_in_one_shard() -> None:
    shards = shard_modules()
    assert set(FLEET_MODULES) <= set(real_modules()), "a listed module that does not exist"
    assert sorted(m for modules in shards.values() for m in modules) == real_modules()


def test_a_run_fails_if_any_shard_failed_or_was_killed() -> None:
    assert overall_exit([0, 0]) == 0
    assert overall_exit([0, 1]) == 1
    assert overall_exit([2, 1]) == 2
    assert overall_exit([-9, 0]) == 1  # killed by a signal: max() would have called it passed
