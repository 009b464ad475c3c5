"""The facade's balancing within a pool, as Envoy configuration: completions keyed by model and
leading prompt go to a twin cluster that follows the replica picker's answer, else hashes the key
with bounded load; everything else stays on least request."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from facade import balancing, envoy_config, options, render
from facade.balancing import PREFIX_HEADER, PrefixAffinity
from facade.picker import CLUSTER_METADATA
from facade.pools import Pool

AFFINITY = PrefixAffinity(chars=100, tokens=10, balance_factor=125)
HASH_ONLY = PrefixAffinity(chars=100, tokens=10, balance_factor=125, picker=False)
SOCKET = Path("/tmp/picker.sock")
CANCEL = "/llmcompletions.v2.CompletionService/CancelCompletion"


def configured(pools: list[Pool], affinity: PrefixAffinity | None) -> dict[str, Any]:
    config = render.render_config(8080, 9901, [("127.0.0.1", 50051)])
    render.configure_routing(config, pools, "", affinity, SOCKET)
    return config


def clusters(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {cluster["name"]: cluster for cluster in config["static_resources"]["clusters"]}


def policy(cluster: dict[str, Any]) -> dict[str, Any]:
    (chosen,) = cluster["load_balancing_policy"]["policies"]
    return chosen["typed_extension_config"]


def test_one_pool_gets_a_twin_that_follows_the_picker_else_hashes_with_bounded_load() -> None:
    found = clusters(configured([], AFFINITY))
    assert set(found) == {"completion_service", "completion_service_prefix", "replica_picker"}
    assert policy(found["completion_service"])["name"].endswith("least_request")
    twin = policy(found["completion_service_prefix"])
    assert twin["name"] == "envoy.load_balancing_policies.override_host"
    # The endpoint picker protocol's names: its metadata, else its header.
    assert twin["typed_config"]["override_host_sources"] == [
        {"metadata": {"key": "envoy.lb", "path": [{"key": "x-gateway-destination-endpoint"}]}},
        {"header": "x-gateway-destination-endpoint"},
    ]
    (fallback,) = twin["typed_config"]["fallback_policy"]["policies"]
    hashed = fallback["typed_extension_config"]
    assert hashed["name"] == "envoy.load_balancing_policies.ring_hash"
    assert hashed["typed_config"]["consistent_hashing_lb_config"]["hash_balance_factor"] == 125
    for kept in ("health_checks", "outlier_detection", "load_assignment"):
        original, copied = (
            found["completion_service"][kept],
            found["completion_service_prefix"][kept],
        )
        if kept == "load_assignment":
            assert copied["endpoints"] == original["endpoints"]
        else:
            assert copied == original


def test_prefix_hash_leaves_the_twin_to_envoys_hashing_alone() -> None:
    config = configured([], HASH_ONLY)
    found = clusters(config)
    assert set(found) == {"completion_service", "completion_service_prefix"}
    assert policy(found["completion_service_prefix"])["name"].endswith("ring_hash")
    assert balancing.PICKER_FILTER not in [f["name"] for f in envoy_config.http_filters(config)]


def test_envoy_asks_the_picker_after_the_key_is_set_and_fails_open() -> None:
    config = configured([], AFFINITY)
    names = [f["name"] for f in envoy_config.http_filters(config)]
    assert names.index(balancing.ROUTING_FILTER) + 1 == names.index(balancing.PICKER_FILTER)
    assert names.index(balancing.PICKER_FILTER) < names.index("envoy.filters.http.router")
    picker = envoy_config.filter_config(config, balancing.PICKER_FILTER)
    assert picker["failure_mode_allow"] is True
    # The request's headers (to pick), the response's headers (who served it) and trailers
    # (its end, with the replica's load report), only.
    sent = {part for part, mode in picker["processing_mode"].items() if mode == "SEND"}
    assert sent == {"request_header_mode", "response_header_mode", "response_trailer_mode"}
    assert set(picker["processing_mode"].values()) <= {"SEND", "SKIP", "NONE"}
    socket = clusters(config)["replica_picker"]["load_assignment"]["endpoints"][0]
    assert socket["lb_endpoints"][0]["endpoint"]["address"] == {"pipe": {"path": str(SOCKET)}}
    # The picker is no replica: no twin, and TLS to replicas does not apply to it.
    assert "replica_picker" not in {c["name"] for c in envoy_config.replica_clusters(config)}
    # It gets what it needs alone: callers' credentials never reach it.
    allowed = {rule["exact"] for rule in picker["forward_rules"]["allowed_headers"]["patterns"]}
    assert allowed == {
        balancing.PATH_HEADER,
        balancing.MODEL_HEADER,  # an adapter's prompts go where it is resident
        "x-cancel-request-id",
        "x-request-id",
        "endpoint-load-metrics-bin",
    }
    # The protocol's metadata: a subset hint and the served endpoint go, the pick comes back.
    assert picker["metadata_options"] == {
        "forwarding_namespaces": {"untyped": ["envoy.lb.subset_hint", "envoy.lb"]},
        "receiving_namespaces": {"untyped": ["envoy.lb"]},
    }


def test_the_served_endpoint_is_put_in_the_metadata_before_the_picker_sees_the_response() -> None:
    config = configured([], AFFINITY)
    names = [f["name"] for f in envoy_config.http_filters(config)]
    # Responses pass the filters in reverse: the header is set, then moved into the metadata,
    # then the picker's filter forwards it.
    assert names.index(balancing.PICKER_FILTER) + 1 == names.index(balancing.SERVED_METADATA_FILTER)
    assert names.index(balancing.SERVED_METADATA_FILTER) + 1 == names.index(
        balancing.SERVED_HEADER_FILTER
    )
    assert names[-1] == "envoy.filters.http.router"
    mutation = envoy_config.filter_config(config, balancing.SERVED_HEADER_FILTER)
    (added,) = mutation["mutations"]["response_mutations"]
    assert added["append"]["header"] == {
        "key": "x-gateway-destination-endpoint-served",
        "value": "%UPSTREAM_HOST%",
    }


def test_cancels_ask_the_holder_first_then_every_other_replica() -> None:
    three = [("127.0.0.1", 1), ("127.0.0.1", 2), ("127.0.0.1", 3)]
    for affinity, cluster in (
        (AFFINITY, "completion_service_prefix"),
        (None, "completion_service"),
    ):
        config = render.render_config(8080, 9901, three)
        render.configure_routing(config, [], "", affinity, SOCKET)
        (cancel,) = [
            r for r in envoy_config.routes(config) if r.get("match", {}).get("path") == CANCEL
        ]
        assert cancel["route"]["cluster"] == cluster
        retries = cancel["route"]["retry_policy"]
        assert retries["num_retries"] == 2  # three replicas
        assert {"name": "grpc-status", "string_match": {"exact": "5"}} in retries[
            "retriable_headers"
        ]
        assert "retriable-headers" in retries["retry_on"].split(",")


@pytest.mark.parametrize("affinity", [AFFINITY, None])
def test_adapter_loads_and_unloads_go_to_each_replica_in_turn(
    affinity: PrefixAffinity | None,
) -> None:
    three = [("127.0.0.1", 1), ("127.0.0.1", 2), ("127.0.0.1", 3)]
    config = render.render_config(8080, 9901, three)
    render.configure_routing(config, [], "", affinity, SOCKET)
    for method in ("LoadLoraAdapter", "UnloadLoraAdapter"):
        path = f"/llmcompletions.v2.CompletionService/{method}"
        (fanout,) = [r for r in envoy_config.routes(config) if r["match"].get("path") == path]
        assert fanout["route"]["cluster"] == "completion_service"  # never the picker's twin
        retries = fanout["route"]["retry_policy"]
        assert retries["num_retries"] == 3  # each replica, then one asked again: "all done"
        assert retries["retriable_headers"] == [
            {"name": "x-llm-completions-fanout", "string_match": {"exact": "continue"}}
        ]
        (predicate,) = retries["retry_host_predicate"]
        assert predicate["name"] == "envoy.retry_host_predicates.previous_hosts"
        assert fanout["request_headers_to_add"][0]["header"]["key"] == "x-llm-completions-fanout"
    (host,) = envoy_config.connection_manager(config)["route_config"]["virtual_hosts"]
    assert host["include_request_attempt_count"] is True


@pytest.mark.parametrize(
    ("address", "kind"),
    [(("127.0.0.1", 50061), "STATIC"), (("llm-completions-picker", 50061), "STRICT_DNS")],
)
def test_a_shared_picker_is_reached_at_its_address(address: tuple[str, int], kind: str) -> None:
    config = render.render_config(8080, 9901, [("127.0.0.1", 1), ("127.0.0.1", 2)])
    render.configure_routing(config, [], "", AFFINITY, address)
    picker = clusters(config)["replica_picker"]
    assert picker["type"] == kind
    (endpoint,) = picker["load_assignment"]["endpoints"][0]["lb_endpoints"]
    host, port = address
    assert endpoint["endpoint"]["address"] == {
        "socket_address": {"address": host, "port_value": port}
    }
    if kind == "STRICT_DNS":  # as `--listen 0.0.0.0` serves, and as replicas resolve
        assert picker["dns_lookup_family"] == "V4_PREFERRED"
    # Across a network, the replicas' pings: a vanished picker is noticed, not waited on.
    replicas = envoy_config.replica_clusters(config)[0]
    keepalive = envoy_config.http2_options(picker)["connection_keepalive"]
    assert keepalive == envoy_config.http2_options(replicas)["connection_keepalive"]


def test_a_picker_beside_envoy_needs_no_pings() -> None:
    picker = clusters(configured([], AFFINITY))["replica_picker"]
    assert "connection_keepalive" not in envoy_config.http2_options(picker)


@pytest.mark.parametrize(
    "pools",
    [
        [],
        [Pool("a", (("10.0.0.1", 1), ("10.0.0.2", 1)), ("a",)), Pool("b", (("b.svc", 2),), ("b",))],
    ],
)
def test_a_shared_picker_knows_the_clusters_envoy_asks_it_about(pools: list[Pool]) -> None:
    upstreams = [("127.0.0.1", 1), ("127.0.0.1", 2)]
    config = render.render_config(8080, 9901, upstreams)
    render.configure_routing(config, pools, "", AFFINITY, ("127.0.0.1", 50061))
    asked = {
        route["route"]["cluster"]: route["route"]["cluster"]
        for route in envoy_config.routes(config)
        if route.get("route", {}).get("cluster", "").endswith(balancing.TWIN_SUFFIX)
    }
    keyed = render.keyed_clusters(upstreams, pools)
    assert set(keyed) == set(asked)
    for cluster in envoy_config.replica_clusters(config):
        if cluster["name"] in keyed:
            endpoints = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
            addresses = [e["endpoint"]["address"]["socket_address"] for e in endpoints]
            expected = keyed[cluster["name"]]
            assert [(a["address"], a["port_value"]) for a in addresses] == list(expected)


def test_replicas_by_name_are_resolved_ipv4_first_as_the_picker_resolves_them() -> None:
    config = render.render_config(8080, 9901, [("replicas.svc", 50051)])
    (cluster,) = envoy_config.replica_clusters(config)
    assert cluster["type"] == "STRICT_DNS"
    assert cluster["dns_lookup_family"] == "V4_PREFERRED"


def test_only_keyed_routes_ask_the_picker_and_name_their_cluster() -> None:
    pools = [Pool("a", (("127.0.0.1", 1),), ("a",)), Pool("b", (("127.0.0.1", 2),), ("b",))]
    for route in envoy_config.routes(configured(pools, AFFINITY)):
        per_route = route["typed_per_filter_config"][balancing.PICKER_FILTER]
        cluster = route.get("route", {}).get("cluster", "")
        if cluster.endswith("_prefix"):
            assert per_route["overrides"]["grpc_initial_metadata"] == [
                {"key": CLUSTER_METADATA, "value": cluster}
            ]
        else:
            assert per_route["disabled"] is True, route


def test_keyed_calls_take_the_twin_and_the_rest_least_request() -> None:
    grpc_routes = [
        r
        for r in envoy_config.routes(configured([], AFFINITY))
        if "route" in r and r["match"].get("prefix") == "/"
    ]
    keyed, plain = grpc_routes
    assert {"name": PREFIX_HEADER, "present_match": True} in keyed["match"]["headers"]
    assert keyed["route"]["cluster"] == "completion_service_prefix"
    assert keyed["route"]["hash_policy"] == [{"header": {"header_name": PREFIX_HEADER}}]
    assert plain["route"]["cluster"] == "completion_service"
    # Retries, timeouts and the reply limit as for any call; a retry tries more ring entries
    # for a replica other than the one that failed.
    keyed_retries, plain_retries = keyed["route"]["retry_policy"], plain["route"]["retry_policy"]
    assert keyed_retries["host_selection_retry_max_attempts"] > 3
    # ...and enough retries for outlier detection (5 failed connections) to eject a dead one.
    assert keyed_retries["num_retries"] >= 5
    tuned = ("host_selection_retry_max_attempts", "num_retries")
    assert {k: v for k, v in keyed_retries.items() if k not in tuned} == {
        k: v for k, v in plain_retries.items() if k not in tuned
    }


def test_each_pool_is_keyed_within_itself() -> None:
    pools = [Pool("a", (("127.0.0.1", 1),), ("a", "a-sql")), Pool("b", (("127.0.0.1", 2),), ("b",))]
    config = configured(pools, AFFINITY)
    assert {"pool_a_prefix", "pool_b_prefix"} <= set(clusters(config))
    for route in envoy_config.routes(config):
        if "route" not in route or route["match"].get("prefix") != "/":
            continue
        keyed = any(h["name"] == PREFIX_HEADER for h in route["match"].get("headers", []))
        cluster = route["route"]["cluster"]
        assert keyed == cluster.endswith("_prefix"), route


def test_least_request_adds_no_key_and_no_twin() -> None:
    config = configured([], None)
    assert set(clusters(config)) == {"completion_service"}
    names = [f["name"] for f in envoy_config.http_filters(config)]
    assert balancing.EXTRACTION not in names and balancing.ROUTING_FILTER not in names


def test_envoy_reads_the_model_and_prompt_of_completions_and_chats_only() -> None:
    fields = balancing.extracted_fields(by_model=False, affinity=AFFINITY)
    assert fields == {
        balancing.CREATE_COMPLETION: ["model", *balancing.PROMPT_FIELDS],
        balancing.CREATE_CHAT_COMPLETION: ["model", *balancing.MESSAGE_FIELDS],
        balancing.CANCEL_COMPLETION: ["request_id"],
    }
    with_pools = balancing.extracted_fields(by_model=True, affinity=AFFINITY)
    for keyed in (balancing.CREATE_COMPLETION, balancing.CREATE_CHAT_COMPLETION):
        assert with_pools[keyed] == fields[keyed]
    assert with_pools[balancing.CANCEL_COMPLETION] == ["model", "request_id"]
    assert all(
        names == ["model"]
        for method, names in with_pools.items()
        if "Create" not in method and "Cancel" not in method and "LoraAdapter" not in method
    )
    for adapter_call in balancing.ADAPTER_METHODS:  # routed to a pool by the adapter's name
        assert with_pools[adapter_call] == ["lora_name"]


@pytest.mark.parametrize(
    ("affinity", "settings"),
    [
        (AFFINITY, "PREFIX_CHARS = 100\nPREFIX_TOKENS = 10\nPREFIX_PATH = true\n"),
        (
            PrefixAffinity(100, 10, picker=False),
            "PREFIX_CHARS = 100\nPREFIX_TOKENS = 10\nPREFIX_PATH = false\n",
        ),
        (None, "PREFIX_CHARS = 0\nPREFIX_TOKENS = 0\nPREFIX_PATH = false\n"),
    ],
)
def test_the_key_settings_reach_the_lua_filter(
    affinity: PrefixAffinity | None, settings: str
) -> None:
    source = balancing.routing_lua(affinity)
    assert source.startswith(settings)
    assert "function envoy_on_request" in source


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], PrefixAffinity()),
        (["--balance", "least-request"], None),
        (["--balance", "prefix-hash"], PrefixAffinity(picker=False)),
        (["--prefix-chars", "64", "--balance-factor", "200"], PrefixAffinity(64, 256, 200)),
    ],
)
def test_balance_options(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], expected: PrefixAffinity | None
) -> None:
    for name in ("BALANCE", "PREFIX_CHARS", "PREFIX_TOKENS", "BALANCE_FACTOR"):
        monkeypatch.delenv(name, raising=False)
    parser = argparse.ArgumentParser()
    options.add_balance_options(parser)
    assert options.affinity_from(parser.parse_args(argv)) == expected


def test_a_balance_factor_below_100_is_refused() -> None:
    parser = argparse.ArgumentParser()
    options.add_balance_options(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--balance-factor", "99"])


@pytest.mark.parametrize(
    ("groups", "several"),
    [
        ([[("127.0.0.1", 1)]], False),
        ([[("127.0.0.1", 1)], [("127.0.0.1", 2)]], False),
        ([[("127.0.0.1", 1), ("127.0.0.1", 2)]], True),
        ([[("replicas.svc", 1)]], True),  # a name can resolve to several replicas
    ],
)
def test_keys_are_computed_only_where_a_pool_has_several_replicas(
    groups: list[list[tuple[str, int]]], several: bool
) -> None:
    assert render.several_replicas(groups) is several
