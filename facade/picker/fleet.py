"""The replicas as Envoy sees them: which are healthy and how many requests each has in flight,
read from Envoy's admin `/clusters` (one `cluster::host::stat::value` line per fact)."""

from __future__ import annotations

import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field

HEALTHY_FLAGS = "healthy"


@dataclass
class Replica:
    healthy: bool = False
    in_flight: int = 0


Clusters = dict[str, dict[str, Replica]]


def parse_clusters(text: str) -> Clusters:
    """Each cluster's hosts (HOST:PORT) with their health and requests in flight."""
    clusters: Clusters = defaultdict(dict)
    for line in text.splitlines():
        parts = line.split("::")
        if len(parts) != 4 or ":" not in parts[1]:
            continue  # a cluster-wide line (outlier settings, circuit breakers, ...)
        cluster, host, stat, value = parts
        replica = clusters[cluster].setdefault(host, Replica())
        if stat == "health_flags":
            replica.healthy = value == HEALTHY_FLAGS
        elif stat == "rq_active":
            replica.in_flight = int(value)
    return dict(clusters)


def read_clusters(admin_url: str, timeout: float = 5.0) -> Clusters:
    """Envoy's view now; raises OSError if its admin does not answer."""
    with urllib.request.urlopen(f"{admin_url}/clusters", timeout=timeout) as reply:
        return parse_clusters(reply.read().decode())


@dataclass
class FleetView:
    """The last reading of Envoy's view, plus the requests sent since, which the reading does
    not count yet: several requests picked between two readings must not all see the same
    idle replica."""

    clusters: Clusters = field(default_factory=dict)
    sent_since: dict[tuple[str, str], int] = field(default_factory=dict)

    def update(self, clusters: Clusters) -> set[tuple[str, str]]:
        """Takes a new reading; returns the (cluster, host) pairs that stopped being healthy."""
        lost = {
            (cluster, host)
            for cluster, hosts in self.clusters.items()
            for host, replica in hosts.items()
            if replica.healthy and not clusters.get(cluster, {}).get(host, Replica()).healthy
        }
        self.clusters = clusters
        self.sent_since = {}
        return lost

    def loads(self, cluster: str) -> dict[str, int]:
        """The cluster's healthy replicas and their requests in flight."""
        return {
            host: replica.in_flight + self.sent_since.get((cluster, host), 0)
            for host, replica in self.clusters.get(cluster, {}).items()
            if replica.healthy
        }

    def sent(self, cluster: str, host: str) -> None:
        self.sent_since[(cluster, host)] = self.sent_since.get((cluster, host), 0) + 1
