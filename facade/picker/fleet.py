"""The replicas: which are healthy, as Envoy's admin `/clusters` shows them (one
`cluster::host::stat::value` line per fact), and how many keyed requests each has in flight, as
the picker counts them (from its pick to the end of the request)."""

from __future__ import annotations

import urllib.request
from collections import Counter, defaultdict
from dataclasses import dataclass, field

HEALTHY_FLAGS = "healthy"


@dataclass
class Replica:
    healthy: bool = False


Clusters = dict[str, dict[str, Replica]]


def parse_clusters(text: str) -> Clusters:
    """Each cluster's hosts (HOST:PORT) with their health."""
    clusters: Clusters = defaultdict(dict)
    for line in text.splitlines():
        parts = line.split("::")
        if len(parts) != 4 or ":" not in parts[1]:
            continue  # a cluster-wide line (outlier settings, circuit breakers, ...)
        cluster, host, stat, value = parts
        replica = clusters[cluster].setdefault(host, Replica())
        if stat == "health_flags":
            replica.healthy = value == HEALTHY_FLAGS
    return dict(clusters)


def read_clusters(admin_url: str, timeout: float = 5.0) -> Clusters:
    """Envoy's view now; raises OSError if its admin does not answer."""
    with urllib.request.urlopen(f"{admin_url}/clusters", timeout=timeout) as reply:
        return parse_clusters(reply.read().decode())


@dataclass
class FleetView:
    """The last reading of Envoy's view, and the keyed requests in flight on each replica.

    In flight is counted here, not read from Envoy: a reading is up to an interval old, and
    a client that sends its next request as soon as one ends would find the ended one still
    counted, and its key spilled for it."""

    clusters: Clusters = field(default_factory=dict)
    in_flight: Counter[tuple[str, str]] = field(default_factory=Counter)

    def update(self, clusters: Clusters) -> set[tuple[str, str]]:
        """Takes a new reading; returns the (cluster, host) pairs that stopped being healthy."""
        lost = {
            (cluster, host)
            for cluster, hosts in self.clusters.items()
            for host, replica in hosts.items()
            if replica.healthy and not clusters.get(cluster, {}).get(host, Replica()).healthy
        }
        self.clusters = clusters
        return lost

    def loads(self, cluster: str) -> dict[str, int]:
        """The cluster's healthy replicas and their keyed requests in flight."""
        return {
            host: self.in_flight[(cluster, host)]
            for host, replica in self.clusters.get(cluster, {}).items()
            if replica.healthy
        }

    def started(self, cluster: str, host: str) -> None:
        self.in_flight[(cluster, host)] += 1

    def ended(self, cluster: str, host: str) -> None:
        self.in_flight[(cluster, host)] -= 1
