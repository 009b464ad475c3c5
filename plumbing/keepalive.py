"""HTTP/2 keepalive as gRPC channel options for the server.

Without these, grpcio's defaults refuse what meshes and many Go and Java clients do: it allows
a caller's ping without data only every 5 minutes and, at the third early one, ends the
connection with GOAWAY ENHANCE_YOUR_CALM "too_many_pings", failing every call on it (a
non-streamed minute-long call with 10 s client keepalive died this way after 50 s). It also
never pings on its own, so a caller that vanished without closing (a crashed host, a dropped
route) keeps its calls, and their engine requests, running until they finish.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KeepaliveSettings:
    """HTTP/2 keepalive on the gRPC listener: the server's own pings, and the callers' pings
    it accepts (docs/operating/keepalive.md says why each default is what it is)."""

    # A connection the caller has sent nothing on for this long gets a ping from the server...
    time_seconds: float = 30.0
    # ...and is closed, its calls cancelled, when the ping is not answered within this.
    timeout_seconds: float = 20.0
    # Callers' pings closer together than this count as strikes...
    min_ping_interval_seconds: float = 5.0
    # ...and past this many strikes the server ends the connection (GOAWAY too_many_pings).
    # 0: never; a caller's keepalive is never held against it.
    max_ping_strikes: int = 0


def milliseconds(seconds: float) -> int:
    return round(seconds * 1000)


def server_options(settings: KeepaliveSettings) -> list[tuple[str, int]]:
    return [
        # The server's pings: a silent connection is pinged, and closed when the ping goes
        # unanswered; closing it cancels its calls, which aborts their engine requests.
        ("grpc.keepalive_time_ms", milliseconds(settings.time_seconds)),
        ("grpc.keepalive_timeout_ms", milliseconds(settings.timeout_seconds)),
        # grpc 1.85 times a sent ping's answer by this one (60 s by default), not by the above.
        ("grpc.http2.ping_timeout_ms", milliseconds(settings.timeout_seconds)),
        # Pings on connections without calls too (both ways): load balancers and meshes hold
        # idle pooled connections, and a dead idle connection should not wait for a call.
        ("grpc.keepalive_permit_without_calls", 1),
        # Keep pinging however long nothing else is sent (grpcio stops after 2 by default).
        ("grpc.http2.max_pings_without_data", 0),
        # The callers' pings accepted: as often as this, and how many earlier ones are borne.
        (
            "grpc.http2.min_recv_ping_interval_without_data_ms",
            milliseconds(settings.min_ping_interval_seconds),
        ),
        ("grpc.http2.max_ping_strikes", settings.max_ping_strikes),
    ]
