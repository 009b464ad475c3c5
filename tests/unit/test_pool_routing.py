"""The facade's configuration for several pools, and what a replica makes of the endpoint's
listing that Envoy passes: no engine, no Envoy."""

from __future__ import annotations

import argparse
import base64
from typing import Any

import pytest
from llmcompletions.v2.completions_pb2 import ListModelsResponse, Model

from facade import balancing, envoy_config, render
from facade.pools import (
    Pool,
    PoolError,
    checked,
    listing_header,
    parse_pool,
    parse_pool_adapters,
    with_adapter_patterns,
)
from plumbing.headers import ENDPOINT_MODELS_HEADER
from service.api import endpoint_models
from service.transport.endpoint_header import passed_listing


def pools() -> list[Pool]:
    return [
        Pool("alpha", (("10.0.0.1", 50051), ("10.0.0.2", 50051)), ("alpha",)),
        Pool("beta", (("beta-pool", 50051),), ("beta", "beta-sql")),
    ]


def listing(*names: str) -> ListModelsResponse:
    return ListModelsResponse(object="list", data=[Model(id=name) for name in names])


def rendered_for(given: list[Pool]) -> dict[str, Any]:
    config = render.render_config(8080, 9901, [("127.0.0.1", 50051)])
    render.configure_routing(
        config, given, listing_header(listing("alpha", "beta", "beta-sql")), affinity=None
    )
    return config


def rendered() -> dict[str, Any]:
    return rendered_for(pools())


def test_the_methods_routed_by_model_are_those_whose_request_names_one() -> None:
    assert sorted(name.rsplit(".", 1)[1] for name in balancing.methods_with_model()) == [
        "CancelCompletion",
        "CreateChatCompletion",
        "CreateCompletion",
        "Detokenize",
        "GetModelInfo",
        "Tokenize",
    ]


def test_each_pool_is_a_cluster_like_the_single_one() -> None:
    config = rendered()
    template = render.TEMPLATE["static_resources"]["clusters"][0]
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    assert list(clusters) == ["pool_alpha", "pool_beta", render.ANY_POOL_CLUSTER]
    for name in ("pool_alpha", "pool_beta"):
        for kept in ("health_checks", "outlier_detection", "load_balancing_policy"):
            assert clusters[name][kept] == template[kept]
    assert clusters["pool_beta"]["type"] == "STRICT_DNS"  # a hostname
    assert clusters["pool_alpha"]["type"] == "STATIC"
    aggregate = clusters[render.ANY_POOL_CLUSTER]["cluster_type"]["typed_config"]
    assert aggregate["clusters"] == ["pool_alpha", "pool_beta"]


def test_each_model_routes_to_its_pool_and_the_rest_to_any_pool_with_the_listing() -> None:
    all_routes = envoy_config.routes(rendered())
    grpc_routes = [r for r in all_routes if "route" in r and r["match"].get("prefix") == "/"]
    cancels = [r for r in all_routes if r["match"].get("path", "").endswith("/CancelCompletion")]
    # Each pool's route is preceded by one for its cancels, to the same cluster.
    assert [r["route"]["cluster"] for r in cancels] == [r["route"]["cluster"] for r in grpc_routes]
    by_model = {
        header["string_match"]["exact"]: route["route"]["cluster"]
        for route in grpc_routes
        for header in route["match"]["headers"]
        if header["name"] == balancing.MODEL_HEADER
    }
    assert by_model == {"alpha": "pool_alpha", "beta": "pool_beta", "beta-sql": "pool_beta"}
    fallback = grpc_routes[-1]
    assert fallback["route"]["cluster"] == render.ANY_POOL_CLUSTER
    # Only the calls no pool owns have the pools asked for their models.
    live = {"filter_metadata": {render.LISTING_FILTER: {render.LIVE_LISTING_KEY: True}}}
    assert [route.get("metadata") for route in grpc_routes] == [None] * 3 + [live]
    added = {h["header"]["key"]: h["header"]["value"] for h in fallback["request_headers_to_add"]}
    passed = ListModelsResponse.FromString(base64.b64decode(added[ENDPOINT_MODELS_HEADER]))
    assert [model.id for model in passed.data] == ["alpha", "beta", "beta-sql"]
    template_route = envoy_config.grpc_route(render.TEMPLATE)
    for route in grpc_routes:  # retries, timeouts and the reply limit as with one pool
        assert route["route"]["retry_policy"] == template_route["route"]["retry_policy"]
        assert route["typed_per_filter_config"] == template_route["typed_per_filter_config"]


def test_the_model_is_read_after_the_transcoder_and_before_the_router() -> None:
    names = [f["name"] for f in envoy_config.http_filters(rendered())]
    start = names.index(envoy_config.TRANSCODER)
    assert names[start:] == [
        envoy_config.TRANSCODER,
        "envoy.filters.http.grpc_field_extraction",
        "llmcompletions.routing",
        render.LISTING_FILTER,
        "envoy.filters.http.router",
    ]


def test_listing_calls_ask_each_pool_and_keep_what_it_listed_at_launch() -> None:
    alpha, beta = (
        Pool(name, (("h", 1),), listing=listing(name).SerializeToString())
        for name in ("alpha", "beta")
    )
    (listing_filter,) = [
        f
        for f in envoy_config.http_filters(rendered_for([alpha, beta]))
        if f["name"] == render.LISTING_FILTER
    ]
    code = listing_filter["typed_config"]["default_source_code"]["inline_string"]
    # Each pool's cluster, and its launch listing as bytes in a Lua string.
    assert 'cluster = "\\112\\111\\111\\108\\095\\097' in code  # "pool_a..."
    for pool in (alpha, beta):
        assert render.lua_bytes(pool.listing) in code
    assert "function envoy_on_request" in code


def test_lua_bytes_escape_every_byte() -> None:
    assert render.lua_bytes(b'\x00a"\xff') == '"\\000\\097\\034\\255"'


@pytest.mark.parametrize("text", ["alpha", "=h:1", "alpha=", "alpha=host", "alpha=h:1,h"])
def test_a_malformed_pool_is_a_usage_error(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_pool(text)


def test_a_pool_is_named_after_its_base_model() -> None:
    served = ListModelsResponse(data=[Model(id="alpha"), Model(id="sql")])
    served.data[0].parent.null_value = 0
    served.data[1].parent.string_value = "alpha"
    assert checked(Pool("alpha", (("h", 1),)), served).models == ("alpha", "sql")
    with pytest.raises(PoolError, match="name each pool after"):
        checked(Pool("beta", (("h", 1),)), served)


def test_a_listing_too_large_for_a_header_stops_the_launcher() -> None:
    many = listing(*(f"adapter-{index:04d}-with-a-long-name" for index in range(400)))
    with pytest.raises(PoolError, match="too many to list"):
        listing_header(many)


class Context:
    def __init__(self, metadata: tuple[tuple[str, Any], ...]) -> None:
        self.metadata = metadata

    def invocation_metadata(self) -> tuple[tuple[str, Any], ...]:
        return self.metadata


def test_a_replica_names_the_endpoints_models_when_the_facade_passes_them() -> None:
    passed = listing("alpha", "beta").SerializeToString()
    token = endpoint_models.bind(passed_listing(Context(((ENDPOINT_MODELS_HEADER, passed),))))
    try:
        assert endpoint_models.served_names(["alpha"]) == ["alpha", "beta"]
        assert endpoint_models.endpoint_listing() == listing("alpha", "beta")
    finally:
        endpoint_models.unbind(token)
    token = endpoint_models.bind(passed_listing(Context(((ENDPOINT_MODELS_HEADER, b"\xff"),))))
    try:
        assert endpoint_models.served_names(["alpha"]) == ["alpha"]  # garbage is ignored
    finally:
        endpoint_models.unbind(token)


def test_a_pools_adapter_patterns_route_its_later_adapters_and_their_loads() -> None:
    """Names a pool gains while it serves (its adapter root, load calls): after every name
    served at start, before the calls no pool owns; an adapter's load or unload is routed by
    its name, to every replica of that pool."""
    patterned = with_adapter_patterns(pools(), [parse_pool_adapters("beta=team-b-*,exact-one")])
    config = render.render_config(8080, 9901, [("127.0.0.1", 50051)])
    render.configure_routing(config, patterned, listing_header(listing("alpha")), affinity=None)
    all_routes = envoy_config.routes(config)
    grpc_routes = [r for r in all_routes if "route" in r and r["match"].get("prefix") == "/"]
    matches = [
        (header["string_match"], route["route"]["cluster"])
        for route in grpc_routes
        for header in route["match"]["headers"]
        if header["name"] == balancing.MODEL_HEADER
    ]
    assert matches[-2:] == [
        ({"prefix": "team-b-"}, "pool_beta"),
        ({"exact": "exact-one"}, "pool_beta"),
    ]
    assert grpc_routes[-1]["route"]["cluster"] == render.ANY_POOL_CLUSTER
    load = "/llmcompletions.v2.CompletionService/LoadLoraAdapter"
    loads = [r for r in all_routes if r["match"].get("path") == load]
    assert {"prefix": "team-b-"} in [
        h["string_match"] for r in loads for h in r["match"]["headers"]
    ]
    fields = balancing.extracted_fields(by_model=True, affinity=None)
    assert fields["llmcompletions.v2.CompletionService.LoadLoraAdapter"] == ["lora_name"]


@pytest.mark.parametrize("text", ["beta", "beta=", "beta=a*b", "beta=*"])
def test_bad_adapter_patterns_are_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_pool_adapters(text)
    with pytest.raises(PoolError):
        with_adapter_patterns(pools(), [("gamma", ("x-*",))])
