"""The replica picker: an endpoint picker (the Gateway API Inference Extension's protocol,
facade/picker/protocol.py) that Envoy asks, for each keyed completion, which replica of the pool
should serve it (facade/balancing.py says when and why).

Envoy sends the prompt's path that facade/routing.lua computed and the pool's cluster; the picker
answers with the replicas to try, in order, in `x-gateway-destination-endpoint` (header and
`envoy.lb` metadata), and the cluster's override-host balancing follows it. It fails open: if the
picker is down, slow or has no answer, Envoy balances by consistent hashing with bounded load
instead.

A picker runs beside one Envoy (started by facade.launch, following that Envoy's view of the
replicas: fleet.py), or is shared by several (facade.launch --picker), checking the replicas'
health itself (health.py), so that a prefix has one home whichever Envoy a request reaches.
"""

from __future__ import annotations

import signal
import subprocess
import sys

from plumbing.lifetime import signal_on_parent_death

# gRPC metadata of Envoy's call to the picker (set per route): the cluster the request goes to.
CLUSTER_METADATA = "x-picker-cluster"


def start_picker(
    socket_path: str,
    admin_url: str,
    balance_factor: int,
    frontend_ports: tuple[tuple[int, ...], ...] = (),
) -> None:
    """Starts the picker, under its supervisor (which restarts it if it exits), beside the
    process about to become Envoy (facade.launch execs it): the supervisor is that process's
    child, and stops the picker when it exits. `frontend_ports`: the ports of each replica
    that runs several frontends."""
    replicas = [
        arg for ports in frontend_ports for arg in ("--frontend-ports", "+".join(map(str, ports)))
    ]
    subprocess.Popen(
        [
            sys.executable,
            "-m",
            "facade.picker.supervisor",
            *("--socket", socket_path),
            *("--admin-url", admin_url),
            *("--balance-factor", str(balance_factor)),
            *replicas,
        ],
        preexec_fn=lambda: signal_on_parent_death(signal.SIGTERM),
    )
