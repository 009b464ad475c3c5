"""Envoy's own limits never bind before the replicas' backlog bounds: every cluster a call
goes through (each pool, its prefix twin, the replica picker, the any-pool fallback) takes as
many streams as many H200 replicas accept, retries follow the load, and the downstream
connection limit fits the open-files limit."""

from __future__ import annotations

from typing import Any

import pytest

from facade import render
from facade.balancing import PrefixAffinity
from facade.pools import Pool
from service.model.capacity import default_queued_reqs

H200_BATCH = 1024
REPLICAS_IN_A_POOL = 64
AFFINITY = PrefixAffinity(chars=100, tokens=10, balance_factor=125)


def fleet_config(open_files: int | None = None) -> dict[str, Any]:
    config = render.render_config(8080, 9901, [("127.0.0.1", 50051)], open_files=open_files)
    pools = [
        Pool("alpha", (("10.0.0.1", 50051), ("10.0.0.2", 50051)), ("alpha",)),
        Pool("beta", (("beta-pool", 50051),), ("beta",)),
    ]
    render.configure_routing(config, pools, "", AFFINITY, ("127.0.0.1", 50061))
    return config


def test_every_cluster_takes_as_many_streams_as_its_replicas_accept() -> None:
    clusters = fleet_config()["static_resources"]["clusters"]
    assert {cluster["name"] for cluster in clusters} >= {
        "pool_alpha",
        "pool_alpha_prefix",
        "pool_beta",
        "replica_picker",
        render.ANY_POOL_CLUSTER,
    }
    accepted = REPLICAS_IN_A_POOL * default_queued_reqs(H200_BATCH)
    for cluster in clusters:
        (thresholds,) = cluster["circuit_breakers"]["thresholds"]
        assert thresholds["max_requests"] >= accepted, cluster["name"]
        assert thresholds["max_pending_requests"] >= accepted, cluster["name"]
        # A budget (a share of the requests in flight), not a fixed count of retries.
        assert "max_retries" not in thresholds
        assert thresholds["retry_budget"]["budget_percent"]["value"] > 0


@pytest.mark.parametrize(
    ("open_files", "connections"),
    [(None, 65536), (1 << 20, 65536), (20000, 20000 - 1024), (1024, 256)],
)
def test_downstream_connections_fit_the_open_files_limit(
    open_files: int | None, connections: int
) -> None:
    monitor = render.connection_monitor(fleet_config(open_files))
    assert monitor["max_active_downstream_connections"] == connections
