"""The tenants file without a model: its validation, keys found by their hashes only, model
patterns, live reloads that keep the last good table, limits per minute and the CLI's hash."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from service.api.rate_limits import RateLimitedError, TenantLimits
from service.api.shared_windows import ServedWindows, store_url
from service.api.tenants import (
    Caller,
    Limits,
    TenantsFileError,
    bind_caller,
    hash_key,
    parse_tenants,
    unbind_caller,
    visible,
)
from service.transport.tenants_file import TenantsFile

KEY_A, KEY_B = "key-of-team-a", "key-of-team-b"


def tenants_yaml(*extra_keys: str, rpm: int | None = None) -> str:
    keys = [f"{{id: a-{i}, sha256: {hash_key(key)}}}" for i, key in enumerate((KEY_A, *extra_keys))]
    limits = f"\n    limits: {{rpm: {rpm}}}" if rpm else ""
    return (
        "version: 1\n"
        "tenants:\n"
        "  team-a:\n"
        f"    keys: [{', '.join(keys)}]\n"
        f"    models: ['smollm2-*']{limits}\n"
        "  team-b:\n"
        f"    keys: [{{id: b-1, sha256: {hash_key(KEY_B)}}}]\n"
    )


def test_a_key_finds_its_tenant_by_hash_and_a_wrong_key_finds_none() -> None:
    table = parse_tenants(tenants_yaml(), "t.yaml")
    caller = table.find(KEY_A)
    assert caller is not None and (caller.tenant, caller.key_id) == ("team-a", "a-0")
    assert caller.models == ("smollm2-*",)
    b = table.find(KEY_B)
    assert b is not None and b.tenant == "team-b" and b.models is None  # every model
    assert table.find("key-of-team-c") is None and table.find(None) is None
    assert hash_key(KEY_A) in tenants_yaml() and KEY_A not in tenants_yaml()


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("version: 2\ntenants: {}\n", "version"),
        ("tenants: {}\n", "version: Field required"),
        ("version: 1\ntenants: {a: {keys: []}}\n", "tenants.a.keys"),
        ("version: 1\ntenants: {a: {keys: [{id: k, sha256: abc}]}}\n", "sha256"),
        (
            "version: 1\ntenants: {a: {keys: [{id: k, sha256: "
            + "a" * 64
            + "}], limits: {rpm: 0}}}\n",
            "limits.rpm",
        ),
        (
            "version: 1\ntenants: {a: {keys: [{id: k, sha256: " + "a" * 64 + "}], moodels: [x]}}\n",
            "moodels",
        ),
        (
            "version: 1\ntenants:\n  a: {keys: [{id: k, sha256: "
            + "a" * 64
            + "}]}\n  b: {keys: [{id: k, sha256: "
            + "a" * 64
            + "}]}\n",
            "also",
        ),
        (
            "version: 1\ntenants: {'bad id!': {keys: [{id: k, sha256: " + "a" * 64 + "}]}}\n",
            "bad id",
        ),
        ("version: [1\n", "not YAML"),
    ],
)
def test_a_file_that_is_wrong_says_where(text: str, problem: str) -> None:
    with pytest.raises(TenantsFileError, match=r"t\.yaml") as error:
        parse_tenants(text, "t.yaml")
    assert problem in str(error.value)


def test_a_tenant_sees_and_reaches_only_its_models() -> None:
    caller = Caller("team-a", "a-0", ("smollm2-*", "sql-?"), Limits())
    none_at_all = Caller("team-c", "c-0", (), Limits())
    names = ["smollm2-135m", "sql-1", "sql-10", "other"]
    assert visible(names) == names  # no tenant: every model
    for who, expected in ((caller, ["smollm2-135m", "sql-1"]), (none_at_all, [])):
        token = bind_caller(who)
        try:
            assert visible(names) == expected
        finally:
            unbind_caller(token)


def test_a_changed_file_is_reloaded_and_a_bad_one_keeps_the_last_table(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text(tenants_yaml())
    results: list[str] = []
    tenants = TenantsFile(path, results.append)
    tenants.check()
    assert results == []  # unchanged
    path.write_text(tenants_yaml("a-new-key"))
    tenants.check()
    assert results == ["reloaded"] and tenants.table.find("a-new-key") is not None
    with caplog.at_level(logging.ERROR):
        path.write_text("version: 1\ntenants: {a: {keys: []}}\n")
        tenants.check()
        tenants.check()  # the same bad content: said and counted once
    assert results == ["reloaded", "invalid"]
    assert tenants.table.find("a-new-key") is not None
    assert "the previous table stays" in caplog.text
    path.unlink()
    tenants.check()
    assert results[-1] == "unreadable" and tenants.table.find(KEY_A) is not None


def test_a_secret_mounted_as_a_directory_is_followed_through_its_symlink_swap(
    tmp_path: Path,
) -> None:
    """Kubernetes updates a Secret volume by writing a new directory and swapping the
    `..data` symlink that the file's own symlink goes through."""
    mount = tmp_path / "secret"
    mount.mkdir()
    first, second = mount / "..2026_12_05_1", mount / "..2026_12_05_2"
    first.mkdir()
    (first / "tenants.yaml").write_text(tenants_yaml())
    (mount / "..data").symlink_to(first.name)
    (mount / "tenants.yaml").symlink_to("..data/tenants.yaml")
    tenants = TenantsFile(mount / "tenants.yaml")
    second.mkdir()
    (second / "tenants.yaml").write_text(tenants_yaml("rotated-key"))
    (mount / "..data_tmp").symlink_to(second.name)
    os.replace(mount / "..data_tmp", mount / "..data")
    tenants.check()
    assert tenants.table.find("rotated-key") is not None


def test_a_spent_limit_refuses_with_the_seconds_until_its_window_frees() -> None:
    async def scenario() -> None:
        limits = TenantLimits()
        burst = Caller("burst", "k", None, Limits(rpm=2, tpm=1_000))
        other = Caller("other", "k", None, Limits(rpm=2))
        for _ in range(2):
            windows = await limits.admit(burst)
        headers = dict(header for window in windows for header in window.headers())
        assert headers["x-ratelimit-remaining-requests"] == "0"
        assert headers["x-ratelimit-limit-tokens"] == "1000"
        with pytest.raises(RateLimitedError) as refused:
            await limits.admit(burst)
        assert refused.value.limit == "rpm" and "rpm" in refused.value.message
        assert 1 <= refused.value.retry_after <= 60
        assert refused.value.metadata() == (("retry-after", str(refused.value.retry_after)),)
        await limits.admit(other)  # another tenant's window
        metered = Caller("metered", "k", None, Limits(tpm=100))
        limits.charge(metered, 60)
        await asyncio.gather(*limits.charges)
        (tokens,) = await limits.admit(metered)
        assert tokens.remaining == 40
        limits.charge(metered, 60)  # past the limit: charged all the same
        await asyncio.gather(*limits.charges)
        with pytest.raises(RateLimitedError, match="tpm"):
            await limits.admit(metered)

    asyncio.run(scenario())


def test_a_replicas_frontends_share_its_parents_windows(tmp_path: Path) -> None:
    """Two frontends' limiters on the parent's windows (over its socket) spend one budget;
    with the parent gone, calls pass and the store's errors are counted."""
    path = str(tmp_path / "windows.sock")
    windows = ServedWindows(path)
    counted: list[tuple[str, str]] = []

    async def scenario() -> None:
        first, second = (
            TenantLimits(store_url(path), counted=lambda *c: counted.append(c)) for _ in range(2)
        )
        caller = Caller("shared", "k", None, Limits(rpm=3, tpm=100))
        remaining = []
        for limits in (first, second, first):
            requests, _ = await limits.admit(caller)
            remaining.append(requests.remaining)
        assert remaining == [2, 1, 0]
        with pytest.raises(RateLimitedError, match="rpm"):
            await second.admit(caller)
        second.charge(caller, 70)
        await asyncio.gather(*second.charges)
        other = Caller("shared", "k", None, Limits(tpm=100))
        (tokens,) = await first.admit(other)
        assert tokens.remaining == 30  # charged through one frontend, seen by the other
        fresh = TenantLimits(
            store_url(str(tmp_path / "gone.sock")), counted=lambda *c: counted.append(c)
        )
        assert await fresh.admit(caller) == ()  # no parent: the call passes
        assert counted and counted[-1][0] == "store"

    try:
        asyncio.run(scenario())
    finally:
        windows.close()
    assert not Path(path).exists()


def test_a_failing_store_lets_calls_pass_or_refuses_them_when_told() -> None:
    async def scenario() -> None:
        counted: list[tuple[str, str]] = []
        caller = Caller("t", "k", None, Limits(rpm=1))
        # Nothing listens on port 9 of loopback: every call to the store fails at once.
        store = "redis://127.0.0.1:9"
        assert await TenantLimits(store, counted=lambda *c: counted.append(c)).admit(caller) == ()
        assert counted and counted[0][0] == "store"
        closed = TenantLimits(store, fail_closed=True)
        with pytest.raises(Exception, match="rate-limit store is unavailable"):
            await closed.admit(caller)

    asyncio.run(scenario())


def test_the_cli_prints_a_keys_hash_and_never_the_key() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "service", "tenants", "hash-key"],
        input=f"{KEY_A}\n",
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.strip() == hash_key(KEY_A) and KEY_A not in done.stdout + done.stderr


def test_a_limits_store_that_cannot_be_used_is_a_usage_error_at_start() -> None:
    from service.cli import build_parser

    for wrong in ("redis://host:notaport", "mysql://db:3306"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--limits-store", wrong])
    args = build_parser().parse_args(["serve", "--limits-store", "redis://127.0.0.1:6379"])
    assert args.limits_store == "redis://127.0.0.1:6379"
