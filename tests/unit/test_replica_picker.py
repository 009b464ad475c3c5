"""The replica picker's choices: new prefixes dealt out evenly, a prompt sent where the most of it
is cached (following a document, not instructions every prompt shares) while that replica is
within the load bound, spilled past it; Envoy's view read from its admin; the answer as Envoy's
override-host balancing reads it."""

from __future__ import annotations

import asyncio
import base64
import itertools
import logging
from collections import Counter
from collections.abc import AsyncIterator
from unittest import mock

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from google.protobuf import struct_pb2
from xds.data.orca.v3.orca_load_report_pb2 import OrcaLoadReport

from facade.picker import CLUSTER_METADATA
from facade.picker.fleet import FleetView, Replica, parse_clusters
from facade.picker.policy import (
    FOLLOW_SHARE,
    CacheAwarePolicy,
    PromptPath,
    level_depth,
    load_bound,
)
from facade.picker.protocol import (
    DESTINATION_HEADER,
    destination_response,
    header_value,
    load_report,
)
from facade.picker.server import Exchange, ReplicaPicker
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


def test_the_answer_names_the_replicas_in_order_in_the_header_and_the_metadata() -> None:
    answer = destination_response([A, B])
    (mutation,) = answer.request_headers.response.header_mutation.set_headers
    assert mutation.header.key == DESTINATION_HEADER == "x-gateway-destination-endpoint"
    assert mutation.header.raw_value == f"{A},{B}".encode()
    assert mutation.append_action == base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    lb = answer.dynamic_metadata.fields["envoy.lb"].struct_value
    assert lb.fields[DESTINATION_HEADER].string_value == f"{A},{B}"


def test_header_values_are_read_raw_or_plain() -> None:
    assert header_value(headers(**{"x-prefix-key": "abc"}).headers.headers, "x-prefix-key") == "abc"
    plain = [base_pb2.HeaderValue(key="x-a", value="v")]
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


def request(subset: list[str] | str | None = None, **values: str) -> ext_proc.ProcessingRequest:
    """A request's headers as Envoy sends them, with a gateway's subset hint if given."""
    message = ext_proc.ProcessingRequest(request_headers=headers(**values))
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.update({"x-gateway-destination-endpoint-subset": subset})
        message.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    return message


def picked(response: ext_proc.ProcessingResponse) -> list[str]:
    mutation = response.request_headers.response.header_mutation.set_headers
    return mutation[0].header.raw_value.decode().split(",") if mutation else []


def two_replicas(*healthy: str) -> ReplicaPicker:
    fleet = FleetView()
    fleet.update({"c": {A: Replica(A in healthy), B: Replica(B in healthy)}})
    return ReplicaPicker(CacheAwarePolicy(balance_factor=125), fleet)


KEYED = {"x-prefix-path": "64 50 k"}


def test_a_cluster_the_picker_does_not_know_is_left_to_envoy_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    picker = two_replicas(A, B)
    with caplog.at_level(logging.WARNING, logger="facade.picker"):
        assert picked(picker.route(Exchange("other_prefix"), request(**KEYED))) == []
        assert picked(picker.route(Exchange("other_prefix"), request(**KEYED))) == []
    (warning,) = caplog.records
    assert "other_prefix" in warning.getMessage()
    assert "--upstream or --pool" in warning.getMessage()
    assert picked(picker.route(Exchange("c"), request(**KEYED)))[0] in (A, B)


def test_before_its_first_view_of_the_replicas_the_picker_leaves_the_choice_to_envoy() -> None:
    picker = ReplicaPicker(CacheAwarePolicy(balance_factor=125), FleetView())
    answer = picker.route(Exchange("c"), request(**KEYED))
    assert answer.HasField("request_headers") and picked(answer) == []


def test_no_ready_replica_is_an_immediate_503() -> None:
    answer = two_replicas().route(Exchange("c"), request(**KEYED))
    assert answer.immediate_response.status.code == 503
    assert answer.immediate_response.grpc_status.status == 14  # UNAVAILABLE


@pytest.mark.parametrize("subset", [[B], f" {B} ", f"{B},127.0.0.1:9"])
def test_a_subset_hint_limits_the_pick(subset: list[str] | str) -> None:
    picker = two_replicas(A, B)
    for key in ("k1", "k2", "k3"):
        answer = picker.route(Exchange("c"), request(subset, **{"x-prefix-path": f"64 50 {key}"}))
        assert picked(answer) == [B]


@pytest.mark.parametrize("subset", [[], ["127.0.0.1:9"], [A]])
def test_a_subset_without_a_ready_replica_is_an_immediate_503(subset: list[str]) -> None:
    answer = two_replicas(B).route(Exchange("c"), request(subset, **KEYED))
    assert answer.immediate_response.status.code == 503
    assert "subset" in answer.immediate_response.details


def report(running: int, waiting: int, bound: int = 100) -> OrcaLoadReport:
    found = OrcaLoadReport()
    found.named_metrics["num_requests_running"] = running
    found.named_metrics["num_requests_waiting"] = waiting
    found.named_metrics["max_num_queued_reqs"] = bound
    return found


def test_reports_count_the_requests_others_sent_in_the_load() -> None:
    fleet = FleetView()
    fleet.update({"c": {A: Replica(True), B: Replica(True)}})
    fleet.started("c", A)
    fleet.started("c", A)
    # One of ours ends, and A reports 6 held: 5 besides our other one came from elsewhere.
    fleet.reported("c", A, report(running=4, waiting=2))
    fleet.ended("c", A)
    assert fleet.loads("c") == {A: 1 + 5, B: 0}


def test_every_replica_at_its_backlog_bound_sheds_with_429() -> None:
    picker = two_replicas(A, B)
    picker.fleet.reported("c", A, report(running=4, waiting=4, bound=8))
    assert picker.route(Exchange("c"), request(**KEYED)).HasField("request_headers")
    picker.fleet.reported("c", B, report(running=8, waiting=2, bound=8))
    answer = picker.route(Exchange("c"), request(**KEYED))
    assert answer.immediate_response.status.code == 429
    assert answer.immediate_response.grpc_status.status == 8  # RESOURCE_EXHAUSTED
    (retry,) = answer.immediate_response.headers.set_headers
    assert (retry.header.key, retry.header.raw_value) == ("retry-after", b"1")


def test_a_cancel_goes_first_to_the_replica_that_holds_the_request_then_to_the_others() -> None:
    picker = two_replicas(A, B)
    exchange = Exchange("c")
    first = picked(picker.route(exchange, request(**KEYED, **{"x-request-id": "r1"})))[0]
    other = B if first == A else A
    assert picked(picker.route(Exchange("c"), request(**{"x-cancel-request-id": "r1"}))) == [
        first,
        other,
    ]
    # Envoy reports that a retry served it on the other replica: the cancel follows.
    served = ext_proc.ProcessingRequest(response_headers=ext_proc.HttpHeaders())
    served.metadata_context.filter_metadata["envoy.lb"].update(
        {"x-gateway-destination-endpoint-served": other}
    )
    picker.served(exchange, served)
    assert picked(picker.route(Exchange("c"), request(**{"x-cancel-request-id": "r1"})))[0] == other
    assert picker.fleet.loads("c") == {other: 1, first: 0}
    picker.release(exchange)
    assert "r1" not in picker.fleet.holders and picker.fleet.loads("c") == {A: 0, B: 0}


def trailer(value: bytes) -> list[base_pb2.HeaderValue]:
    return [base_pb2.HeaderValue(key="endpoint-load-metrics-bin", raw_value=value)]


def test_a_load_report_is_read_from_the_trailer_base64_as_envoy_passes_it() -> None:
    sent = report(running=3, waiting=1)
    value = base64.b64encode(sent.SerializeToString()).rstrip(b"=")
    assert load_report(trailer(value)) == sent
    assert load_report(trailer(b"%%")) is None
    assert load_report([]) is None


def test_a_picker_that_ran_steadily_is_restarted_at_once() -> None:
    assert next_delay(8.0, ran_seconds=STEADY_SECONDS) == 0.0


def test_a_picker_that_keeps_exiting_at_start_waits_longer_each_time_up_to_a_limit() -> None:
    delays = [0.0]
    for _ in range(8):
        delays.append(next_delay(delays[-1], ran_seconds=0.1))
    assert delays[1:4] == [1.0, 2.0, 4.0]
    assert delays[-1] == MAX_DELAY_SECONDS


def test_a_picker_told_to_ignore_reports_counts_only_its_own_requests() -> None:
    fleet = FleetView(count_reports=False)
    fleet.update({"c": {A: Replica(True), B: Replica(True)}})
    fleet.started("c", A)
    fleet.reported("c", A, report(running=4, waiting=2, bound=6))
    assert fleet.loads("c") == {A: 1, B: 0}
    assert not fleet.saturated("c", [A])


def test_a_request_without_a_prompt_path_goes_to_the_least_loaded_replica() -> None:
    """Behind a gateway without our routing filter the picker still answers, by load."""
    picker = two_replicas(A, B)
    picker.fleet.started("c", A)
    assert picked(picker.route(Exchange("c"), request())) == [B, A]


def test_a_gateway_that_names_no_cluster_gets_a_pick_from_the_picker_of_one_pool() -> None:
    """An Inference Extension gateway (an InferencePool's endpoint picker) sends no cluster
    metadata: a picker following one pool picks among its replicas, and one following several
    leaves the choice to the gateway."""
    assert picked(two_replicas(A, B).route(Exchange(""), request([B], **KEYED))) == [B]
    several = FleetView()
    several.update({"c": {A: Replica(True)}, "d": {B: Replica(True)}})
    unsure = ReplicaPicker(CacheAwarePolicy(balance_factor=125), several)
    answer = unsure.route(Exchange(""), request(**KEYED))
    assert answer.HasField("request_headers") and picked(answer) == []


def test_an_adapters_new_prompts_go_where_it_is_resident_and_spill_past_the_bound() -> None:
    policy = CacheAwarePolicy(balance_factor=125)
    # Without an adapter resident anywhere, new prompts are dealt out evenly; with it on B,
    # they all go to B while B is within the bound, even though B is home to more of them.
    prompts = [whole(f"sql-{index}") for index in range(6)]
    assert {policy.choose("pool", path, IDLE, {B})[0] for path in prompts} == {B}
    assert policy.choose("pool", whole("sql-busy"), {A: 0, B: 6}, {B})[0] == A  # spilled
    # The base model's new prompts (no adapter) even the homes out: A is home to fewer.
    assert Counter(first_picks(policy, [f"base-{i}" for i in range(2)], IDLE)) == {A: 2}


def test_load_reports_say_which_adapters_each_replica_holds() -> None:
    fleet = FleetView()
    fleet.update({"c": {A: Replica(True), B: Replica(True)}})
    with_sql = report(1, 0)
    with_sql.named_metrics["adapter.sql"] = 1
    for host, sent in ((A, with_sql), (B, report(1, 0))):
        fleet.started("c", host)
        fleet.reported("c", host, sent)
        fleet.ended("c", host)
    assert fleet.holding("c", "sql") == {A}
    assert fleet.holding("c", "chat") == set()
    assert fleet.holding("other", "sql") == set()
