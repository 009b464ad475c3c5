"""gRPC core's bound on calls that have arrived but that the server's event loop has not
picked up yet, as channel options for every gRPC server of the product (the service and the
replica picker).

grpcio's defaults refuse part of a burst before any of our code sees it: past 1,000 such calls
it cancels new ones at random, and every one past 3,000 (a burst of 1,500 streams on one
connection lost 58, one of 3,000 lost about 700). A replica's own backlog bounds
(service.api.backlog) decide what is refused, with a clear status and a retry hint; these
bounds sit far above them (an H200's default backlog is 8,192 sequences) and only stop a flood
that the server cannot even pick up. The server starts listening before the engine has
resolved its batch, so they cannot follow it: they are sized for the largest device.
"""

from __future__ import annotations

# Below this many unpicked calls none is refused; between it and the hard limit, some are.
MAX_PENDING_CALLS = 32_768
MAX_PENDING_CALLS_HARD = 65_536


def call_backlog_options() -> list[tuple[str, int]]:
    return [
        ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
        ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS_HARD),
    ]
