"""A replica with several frontend processes (API_SERVER_COUNT > 1) behind the picker: its
frontends are one replica with one cache. Prefix homes, load, load reports, the load bound and
health are the replica's; within it, the frontend with the fewest of the picker's requests
takes the next one. Named on the command line as HOST:PORT+PORT..."""

from __future__ import annotations

import argparse
from collections import Counter

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc

from facade.addresses import FrontendGroups, parse_frontend_ports, parse_replica
from facade.launch import balancing
from facade.options import build_parser, fleet_from
from facade.picker.fleet import FleetView, Replica
from facade.picker.policy import CacheAwarePolicy
from facade.picker.server import Exchange, ReplicaPicker
from facade.pools import parse_pool
from facade.stack import Stack
from tests.unit.test_replica_picker import picked, report, request

# Two replicas on one host (as the tests' fleets run), each with two frontends.
A0, A1, B0, B1 = "127.0.0.1:6000", "127.0.0.1:6001", "127.0.0.1:7000", "127.0.0.1:7001"
GROUPS = FrontendGroups(((6000, 6001), (7000, 7001)))


def fleet_of(*healthy: str) -> FleetView:
    fleet = FleetView(frontends=GROUPS)
    fleet.update({"c": {host: Replica(host in healthy) for host in (A0, A1, B0, B1)}})
    return fleet


def keyed(key: str) -> ext_proc.ProcessingRequest:
    return request(**{"x-prefix-path": f"64 50 {key}"})


def test_a_replica_is_written_with_its_frontends_ports() -> None:
    assert parse_replica("llm.svc:50052+50053") == (("llm.svc", 50052), ("llm.svc", 50053))
    assert parse_replica("10.0.0.1:50051") == (("10.0.0.1", 50051),)
    assert parse_frontend_ports("50052+50053") == (50052, 50053)
    for wrong_ports in ("50052+", "50052+50052", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_frontend_ports(wrong_ports)
    for wrong in ("llm.svc:50052+", "llm.svc:50052+50052", "llm.svc", ":1+2"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_replica(wrong)
    pool = parse_pool("chat=10.0.0.1:50052+50053,10.0.0.2:50052+50053")
    assert pool.addresses == (
        ("10.0.0.1", 50052),
        ("10.0.0.1", 50053),
        ("10.0.0.2", 50052),
        ("10.0.0.2", 50053),
    )
    assert pool.frontend_ports == ((50052, 50053), (50052, 50053))


def test_frontends_on_one_ip_are_one_replica_named_by_the_first() -> None:
    assert [GROUPS.replica_of(host) for host in (A0, A1, B0, B1)] == [A0, A0, B0, B0]
    # A name that resolves to several pods: each pod's IP is a replica of its own.
    pods = FrontendGroups(((50052, 50053),))
    assert pods.replica_of("10.0.0.7:50053") == "10.0.0.7:50052"
    assert pods.replica_of("[fd00::7]:50053") == "[fd00::7]:50052"
    assert pods.replica_of("10.0.0.7:50051") == "10.0.0.7:50051"  # not a frontend's port


def test_envoy_and_its_picker_see_one_replica_per_group() -> None:
    parser = build_parser("test")
    one = fleet_from(parser.parse_args(["--upstream", "127.0.0.1:6000+6001"]), parser)
    assert one.upstreams == [("127.0.0.1", 6000), ("127.0.0.1", 6001)]  # Envoy's endpoints
    assert one.groups == [[("127.0.0.1", 6000)]]
    assert balancing(parser.parse_args([]), one) is None  # one cache: by load, no keys
    args = ["--upstream", "127.0.0.1:6000+6001", "--upstream", "127.0.0.1:7000+7001"]
    two = fleet_from(parser.parse_args(args), parser)
    assert two.frontends == GROUPS
    assert balancing(parser.parse_args(args), two) is not None


def test_the_stack_gives_envoy_its_frontends_as_one_replica(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("FRONTEND_PORTS", raising=False)
    command = Stack(grpc_port=50051, env={"API_SERVER_COUNT": "2"}).envoy_command()
    assert command[command.index("--upstream") + 1] == "127.0.0.1:50052+50053"
    alone = Stack(grpc_port=50051, env={"API_SERVER_COUNT": "1"}).envoy_command()
    assert alone[alone.index("--upstream") + 1] == "127.0.0.1:50051"


def test_new_prefixes_are_dealt_out_per_replica_not_per_frontend() -> None:
    picker = ReplicaPicker(CacheAwarePolicy(balance_factor=125), fleet_of(A0, A1, B0, B1))
    firsts = [picked(picker.route(Exchange("c"), keyed(f"k{i}")))[0] for i in range(8)]
    replicas = Counter(GROUPS.replica_of(host) for host in firsts)
    assert replicas == {A0: 4, B0: 4}


def test_a_prefix_stays_on_its_replica_and_spreads_over_its_frontends_by_load() -> None:
    fleet = fleet_of(A0, A1, B0, B1)
    picker = ReplicaPicker(CacheAwarePolicy(balance_factor=200), fleet)
    exchanges = [Exchange("c") for _ in range(4)]
    answers = [picked(picker.route(exchange, keyed("doc"))) for exchange in exchanges]
    home = GROUPS.replica_of(answers[0][0])
    assert {GROUPS.replica_of(answer[0]) for answer in answers} == {home}
    # Each pick counts on its frontend until it ends: the frontends take turns.
    assert Counter(answer[0] for answer in answers) == {home: 2, home[:-1] + "1": 2}
    # The rest of the answer, for retries: the same replica's other frontend, then the other
    # replica's frontends.
    first = answers[0]
    assert [GROUPS.replica_of(host) for host in first] == [
        home,
        home,
        *[B0 if home == A0 else A0] * 2,
    ]


def test_the_load_bound_counts_a_replicas_requests_on_all_its_frontends() -> None:
    fleet = fleet_of(A0, A1, B0, B1)
    for host in (A0, A0, A1):
        fleet.started("c", host)
    assert fleet.loads("c") == {A0: 3, B0: 0}
    # A report from either frontend is the whole replica's (both frontends' requests), sent
    # as its request ended: of the 8 it holds, our other two are on A0, so 6 came from others.
    fleet.reported("c", A1, report(running=6, waiting=2))
    fleet.ended("c", A1)
    assert fleet.loads("c") == {A0: 2 + 6, B0: 0}


def test_a_replica_at_its_bound_sheds_whichever_frontend_reported() -> None:
    picker = ReplicaPicker(CacheAwarePolicy(balance_factor=125), fleet_of(A0, A1))
    picker.fleet.reported("c", A1, report(running=6, waiting=2, bound=8))
    assert picker.route(Exchange("c"), keyed("k")).immediate_response.status.code == 429


def test_a_replica_leaves_when_its_last_frontend_does() -> None:
    fleet = fleet_of(A0, A1, B0, B1)
    lost = fleet.update({"c": {A0: Replica(False), A1: Replica(True), B0: Replica(True)}})
    assert lost == set() and fleet.loads("c") == {A0: 0, B0: 0}
    lost = fleet.update({"c": {A0: Replica(False), A1: Replica(False), B0: Replica(True)}})
    assert lost == {("c", A0)}
    picker = ReplicaPicker(CacheAwarePolicy(balance_factor=125), fleet)
    assert picked(picker.route(Exchange("c"), keyed("k"))) == [B0]
