"""The replica picker's choices: new prefixes dealt out evenly, a prompt sent where the most of it
is cached (following a document, not instructions every prompt shares) while that replica is
within the load bound, spilled past it; Envoy's view read from its admin; the answer as Envoy's
override-host balancing reads it."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import Counter
from collections.abc import AsyncIterator
from unittest import mock

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc

from facade.picker import CLUSTER_METADATA, REPLICA_HEADER
from facade.picker.fleet import FleetView, Replica, parse_clusters
from facade.picker.policy import (
    FOLLOW_SHARE,
    CacheAwarePolicy,
    PromptPath,
    level_depth,
    load_bound,
)
from facade.picker.server import ReplicaPicker, header_value, replica_response
from facade.picker.supervisor import MAX_DELAY_SECONDS, STEADY_SECONDS, next_delay

A, B = "127.0.0.1:1", "127.0.0.1:2"
IDLE = {A: 0, B: 0}


def whole(key: str) -> PromptPath:
    """A short prompt: one key, for all of it."""
    return PromptPath(base=64, length=50, keys=(key,))


def first_picks(policy: CacheAwarePolicy, keys: list[str], loads: dict[str, int]) -> list[str]:
    return [policy.choose("pool", whole(key), loads)[0] for key in keys]


def prompt_path(*parts: tuple[str, int], base: int = 64) -> PromptPath:
    """The path routing.lua sends for a prompt made of these parts (a name, and its length):
    prompts share a key where the same parts cover its depth."""
    length = sum(size for _, size in parts)
    keys: list[str] = []
    while not keys or PromptPath(base, length, ()).depth(len(keys) - 1) < length:
        depth = PromptPath(base, length, ()).depth(len(keys))
        starts = itertools.accumulate((size for _, size in parts), initial=0)
        covered = [name for (name, _), start in zip(parts, starts, strict=False) if start < depth]
        keys.append(f"{'/'.join(covered)}@{depth}")
    return PromptPath(base, length, tuple(keys))


def document_prompt(document: str, question: str, instructions: int = 0) -> PromptPath:
    """A prompt of `instructions` bytes every prompt starts with, then a document of 4 KiB, then
    a question of 40 bytes."""
    head = [("rules", instructions)] if instructions else []
    return prompt_path(*head, (document, 4096), (question, 40))


def test_new_keys_are_dealt_out_evenly() -> None:
    policy = CacheAwarePolicy(balance_factor=125)
    assert Counter(first_picks(policy, [f"key{i}" for i in range(8)], IDLE)) == {A: 4, B: 4}
    two = CacheAwarePolicy(balance_factor=125)
    assert set(first_picks(two, ["x", "y"], IDLE)) == {A, B}


def test_a_documents_prompts_stay_together_and_new_documents_are_dealt_out() -> None:
    policy = CacheAwarePolicy(balance_factor=125)
    asked = [document_prompt(f"doc{d}", f"q{q}") for q in range(3) for d in range(8)]
    picks = [policy.choose("pool", path, IDLE)[0] for path in asked]
    homes = picks[:8]
    assert Counter(homes) == {A: 4, B: 4}
    assert picks[8:16] == homes and picks[16:] == homes
    assert policy.decisions == {"new branch": 8, "home": 16}


def test_instructions_every_prompt_shares_do_not_pull_their_documents_together() -> None:
    policy = CacheAwarePolicy(balance_factor=125)
    # 2,000 bytes of instructions ahead of 4 KiB documents: a third of the prompt, short of
    # the share a prompt must have in common with a known one to follow it.
    asked = [document_prompt(f"doc{d}", f"q{q}", 2000) for q in range(2) for d in range(8)]
    assert FOLLOW_SHARE * asked[0].length > 2000
    picks = [policy.choose("pool", path, IDLE)[0] for path in asked]
    assert Counter(picks[:8]) == {A: 4, B: 4}
    assert picks[8:] == picks[:8]
    assert policy.decisions == {"new branch": 8, "home": 8}


def test_a_conversation_follows_its_earlier_turns() -> None:
    policy = CacheAwarePolicy(balance_factor=125)
    turns = [("opening", 1000)]
    picks = []
    for turn in range(4):  # each turn's prompt is the last one's, its answer and a question
        first_picks(policy, [f"other{turn}"], IDLE)  # other prefixes dealt out meanwhile
        picks.append(policy.choose("pool", prompt_path(*turns), IDLE)[0])
        turns += [(f"answer{turn}", 200), (f"question{turn}", 150)]
    assert picks == [picks[0]] * 4
    assert policy.decisions == {"new branch": 5, "home": 3}


def test_a_prompt_less_than_half_cached_anywhere_is_a_new_branch() -> None:
    policy = CacheAwarePolicy(balance_factor=125)
    first = policy.choose("pool", prompt_path(("opening", 300)), IDLE)[0]
    # A long answer and question after a short opening: most of the prompt is new.
    second = policy.choose("pool", prompt_path(("opening", 300), ("answer", 600)), IDLE)[0]
    assert policy.decisions == {"new branch": 2}
    assert {first, second} == {A, B}


def test_a_prompt_longer_than_the_deepest_level_follows_what_its_keys_cover() -> None:
    policy = CacheAwarePolicy(balance_factor=125)
    keys = tuple(f"book/{level}" for level in range(25))  # routing.lua's 25 levels
    first = policy.choose("pool", PromptPath(64, 900_000, keys), IDLE)[0]
    again = policy.choose("pool", PromptPath(64, 1_000_000, (*keys[:-1], "other")), IDLE)[0]
    assert again == first
    assert policy.decisions == {"new branch": 1, "home": 1}


def test_the_path_deepens_by_at_most_half_at_each_level() -> None:
    assert [level_depth(64, level) for level in range(7)] == [64, 96, 128, 192, 256, 384, 512]
    assert level_depth(16, 24) == 16 * 4096  # the deepest of routing.lua's 25 levels


def test_the_prompts_path_is_read_from_its_header() -> None:
    path = PromptPath.parse("64 120 a1 b2 c3")
    assert path == PromptPath(64, 120, ("a1", "b2", "c3"))
    assert [path.depth(level) for level in range(3)] == [64, 96, 120]
    for malformed in ("", "64 300", "x 300 a1", "0 300 a1", "64 -1 a1", "64 0 a1"):
        assert PromptPath.parse(malformed) is None


def test_a_key_stays_on_its_replica_within_the_bound() -> None:
    policy = CacheAwarePolicy(balance_factor=125)
    (home,) = first_picks(policy, ["key"], IDLE)
    other = B if home == A else A
    # Its replica busier, but within its bound (ceil(ceil(1.25 x 5) / 2) = 4).
    assert first_picks(policy, ["key"] * 3, {home: 3, other: 1}) == [home] * 3


def test_a_hot_key_spills_past_the_bound_and_comes_home_when_there_is_room() -> None:
    policy = CacheAwarePolicy(balance_factor=125)
    (home,) = first_picks(policy, ["hot"], IDLE)
    other = B if home == A else A
    assert first_picks(policy, ["hot"], {home: 6, other: 0}) == [other]
    # Home again as soon as it is within the bound (ceil(ceil(1.25 x 4) / 2) = 3), though busier.
    assert first_picks(policy, ["hot"], {home: 2, other: 1}) == [home]


def test_a_spill_goes_where_the_key_spilled_before() -> None:
    policy = CacheAwarePolicy(balance_factor=125)
    c = "127.0.0.1:3"
    (home,) = first_picks(policy, ["hot"], {A: 0, B: 0, c: 0})
    first_spill = first_picks(policy, ["hot"], {A: 0, B: 0, c: 0} | {home: 9})[0]
    # Later, with home full: the earlier spill replica, within the bound, though not the least
    # loaded (ceil(ceil(1.25 x 13) / 3) = 6).
    third = ({A, B, c} - {home, first_spill}).pop()
    loads = {home: 9, first_spill: 3, third: 0}
    assert first_picks(policy, ["hot"], loads) == [first_spill]


def test_spills_do_not_count_as_homes() -> None:
    policy = CacheAwarePolicy(balance_factor=125)
    (home,) = first_picks(policy, ["hot"], IDLE)
    other = B if home == A else A
    first_picks(policy, ["hot"], {home: 6, other: 0})  # spilled to other
    # The next new key still goes to the replica that is home to fewer keys.
    assert first_picks(policy, ["new"], IDLE) == [other]


def test_the_other_replicas_follow_for_retries_least_loaded_first() -> None:
    policy = CacheAwarePolicy(balance_factor=125)
    c = "127.0.0.1:3"
    order = policy.choose("pool", whole("key"), {A: 2, B: 1, c: 0})
    assert order[0] == c and order[1:] == [B, A]


def test_no_healthy_replica_leaves_the_choice_to_envoy() -> None:
    assert CacheAwarePolicy(balance_factor=125).choose("pool", whole("key"), {}) == []


def test_a_replica_that_left_hands_its_keys_to_their_next_holder() -> None:
    policy = CacheAwarePolicy(balance_factor=125)
    (home,) = first_picks(policy, ["key"], IDLE)
    other = B if home == A else A
    assert first_picks(policy, ["key"], {other: 0}) == [other]  # home unhealthy meanwhile
    policy.forget_replica("pool", home)
    assert policy.keys[("pool", "key")].holders == [other]
    assert policy.homes[("pool", other)] == 1 and policy.homes[("pool", home)] == 0
    # Home back (restarted, cold): the key stays with its new home.
    assert first_picks(policy, ["key"], IDLE) == [other]


def test_pools_are_dealt_separately() -> None:
    policy = CacheAwarePolicy(balance_factor=125)
    assert policy.choose("one", whole("k1"), IDLE)[0] == policy.choose("two", whole("k1"), IDLE)[0]


def test_the_least_recently_used_keys_are_forgotten() -> None:
    policy = CacheAwarePolicy(balance_factor=125, max_keys=2)
    first_picks(policy, ["k1", "k2", "k3"], IDLE)
    assert list(policy.keys) == [("pool", "k2"), ("pool", "k3")]
    assert sum(policy.homes.values()) == 2


def test_the_bound_is_envoys() -> None:
    assert load_bound({A: 0, B: 0}, 125) == 1
    assert load_bound({A: 3, B: 1}, 125) == 4
    assert load_bound({A: 3, B: 1}, 100) == 3


ADMIN_CLUSTERS = """\
completion_service_prefix::default_priority::max_connections::1024
completion_service_prefix::outlier::success_rate_average::-1
completion_service_prefix::127.0.0.1:1::rq_active::3
completion_service_prefix::127.0.0.1:1::health_flags::healthy
completion_service_prefix::127.0.0.1:2::rq_active::0
completion_service_prefix::127.0.0.1:2::health_flags::/failed_active_hc
"""


def test_envoys_admin_view_is_read() -> None:
    clusters = parse_clusters(ADMIN_CLUSTERS)
    assert clusters == {
        "completion_service_prefix": {
            A: Replica(healthy=True),
            B: Replica(healthy=False),
        }
    }


def test_keyed_requests_count_as_load_from_pick_to_end_on_healthy_replicas() -> None:
    fleet = FleetView()
    assert fleet.update(parse_clusters(ADMIN_CLUSTERS)) == set()
    fleet.started("completion_service_prefix", A)
    fleet.started("completion_service_prefix", A)
    fleet.ended("completion_service_prefix", A)
    # Envoy's own rq_active (3, up to a reading old) is not used; B is not healthy.
    assert fleet.loads("completion_service_prefix") == {A: 1}
    lost = fleet.update({"completion_service_prefix": {A: Replica(False)}})
    assert lost == {("completion_service_prefix", A)}
    assert fleet.loads("completion_service_prefix") == {}


def headers(**values: str) -> ext_proc.HttpHeaders:
    return ext_proc.HttpHeaders(
        headers=base_pb2.HeaderMap(
            headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()]
        )
    )


def test_the_answer_names_the_replicas_in_order_for_override_host() -> None:
    (mutation,) = replica_response([A, B]).request_headers.response.header_mutation.set_headers
    assert mutation.header.key == REPLICA_HEADER
    assert mutation.header.raw_value == f"{A},{B}".encode()
    assert mutation.append_action == base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    empty = replica_response([])
    assert (
        empty.HasField("request_headers")
        and not empty.request_headers.response.header_mutation.set_headers
    )


def test_header_values_are_read_raw_or_plain() -> None:
    assert header_value(headers(**{"x-prefix-key": "abc"}), "x-prefix-key") == "abc"
    plain = ext_proc.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key="x-a", value="v")])
    )
    assert header_value(plain, "x-a") == "v"
    assert header_value(plain, "x-b") is None


async def envoy_call(
    picker: ReplicaPicker, key: str, ended: asyncio.Event
) -> list[ext_proc.ProcessingResponse]:
    """One keyed request as Envoy sends it: headers, then (once `ended` is set) trailers."""

    async def messages() -> AsyncIterator[ext_proc.ProcessingRequest]:
        path = f"64 50 {key}"
        yield ext_proc.ProcessingRequest(request_headers=headers(**{"x-prefix-path": path}))
        await ended.wait()
        yield ext_proc.ProcessingRequest(response_trailers=ext_proc.HttpTrailers())

    context = mock.Mock()
    context.invocation_metadata.return_value = ((CLUSTER_METADATA, "c"),)
    return [response async for response in picker.Process(messages(), context)]


def test_a_pick_counts_as_load_until_its_request_ends() -> None:
    async def scenario() -> None:
        fleet = FleetView()
        fleet.update({"c": {A: Replica(True), B: Replica(True)}})
        picker = ReplicaPicker(CacheAwarePolicy(balance_factor=100), fleet)
        ended = asyncio.Event()
        # Three requests of one key in flight: all at home (a bound of the average lets a
        # replica hold up to ceil((all + 1) / 2) before it takes one more).
        calls = [asyncio.create_task(envoy_call(picker, "key", ended)) for _ in range(3)]
        while sum(fleet.loads("c").values()) < 3:
            await asyncio.sleep(0.001)
        (home,) = [host for host, load in fleet.loads("c").items() if load == 3]
        # A fourth while they run: past the bound, so it goes to the other replica.
        done = asyncio.Event()
        done.set()
        (picked, trailers) = await envoy_call(picker, "key", done)
        mutation = picked.request_headers.response.header_mutation.set_headers[0]
        assert mutation.header.raw_value.decode().split(",")[0] != home
        assert trailers.HasField("response_trailers")
        ended.set()
        await asyncio.gather(*calls)
        assert fleet.loads("c") == {A: 0, B: 0}

    asyncio.run(scenario())


def test_a_cluster_the_picker_does_not_know_is_left_to_envoy_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fleet = FleetView()
    fleet.update({"c": {A: Replica(True), B: Replica(True)}})
    picker = ReplicaPicker(CacheAwarePolicy(balance_factor=125), fleet)
    path = PromptPath(64, 50, ("k",))
    with caplog.at_level(logging.WARNING, logger="facade.picker"):
        assert picker.pick("other_prefix", path) == []
        assert picker.pick("other_prefix", path) == []
    (warning,) = caplog.records
    assert "other_prefix" in warning.getMessage()
    assert "--upstream or --pool" in warning.getMessage()
    assert picker.pick("c", path)[0] in (A, B)


def test_a_picker_that_ran_steadily_is_restarted_at_once() -> None:
    assert next_delay(8.0, ran_seconds=STEADY_SECONDS) == 0.0


def test_a_picker_that_keeps_exiting_at_start_waits_longer_each_time_up_to_a_limit() -> None:
    delays = [0.0]
    for _ in range(8):
        delays.append(next_delay(delays[-1], ran_seconds=0.1))
    assert delays[1:4] == [1.0, 2.0, 4.0]
    assert delays[-1] == MAX_DELAY_SECONDS
