"""The replicas: which are healthy, as Envoy's admin `/clusters` shows them (one
`cluster::host::stat::value` line per fact); how many keyed requests each has in flight, as
the picker counts them (from its pick to the end of the request); what each last reported of
its load (the ORCA report on its replies), which counts the requests others sent it (another
Envoy, a client on its gRPC port), and which adapters it holds in memory; and which replica
holds each request id in flight, for cancels.

Envoy's hosts are endpoints; a replica running several frontend processes is several of them
over one engine (facade.addresses.FrontendGroups). Load, load reports and health for routing
are per replica, summed over its frontends; a replica is named by its first frontend."""

from __future__ import annotations

import time
import urllib.request
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from xds.data.orca.v3.orca_load_report_pb2 import OrcaLoadReport

from facade.addresses import FrontendGroups
from plumbing.headers import ADAPTER_METRIC_PREFIX

HEALTHY_FLAGS = "healthy"
# A replica's report counts this long: one that got no reply through this picker since may
# have drained what others sent it.
REPORT_FRESH_SECONDS = 10.0


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
    in_flight: Counter[tuple[str, str]] = field(default_factory=Counter)  # per endpoint
    reports: dict[tuple[str, str], Reported] = field(default_factory=dict)  # per replica
    holders: dict[str, str] = field(default_factory=dict)  # request id -> HOST:PORT
    synced: bool = False  # a first reading was taken
    count_reports: bool = True  # off: a replica's load is only what this picker sent it
    frontends: FrontendGroups = field(default_factory=FrontendGroups)

    def update(self, clusters: Clusters) -> set[tuple[str, str]]:
        """Takes a new reading; returns the (cluster, replica) pairs that stopped having a
        healthy endpoint."""
        before = {
            (cluster, self.replica_of(host))
            for cluster in self.clusters
            for host in self.healthy(cluster)
        }
        self.clusters = clusters
        self.synced = True
        now = {
            (cluster, self.replica_of(host))
            for cluster in clusters
            for host in self.healthy(cluster)
        }
        return before - now

    def sole_cluster(self) -> str | None:
        """The one cluster of replicas this view follows, if it follows one."""
        return next(iter(self.clusters)) if len(self.clusters) == 1 else None

    def healthy(self, cluster: str) -> list[str]:
        """The cluster's healthy endpoints."""
        return [host for host, replica in self.clusters.get(cluster, {}).items() if replica.healthy]

    def replica_of(self, host: str) -> str:
        return self.frontends.replica_of(host)

    def by_replica(self, hosts: list[str]) -> dict[str, list[str]]:
        """Endpoints under the replica each is a frontend of."""
        replicas: dict[str, list[str]] = defaultdict(list)
        for host in hosts:
            replicas[self.replica_of(host)].append(host)
        return dict(replicas)

    def loads(self, cluster: str) -> dict[str, int]:
        """The replicas with a healthy endpoint, and their requests: those this picker sent
        (to any of their frontends), plus those others did as of their last fresh report."""
        ours = self.ours_by_replica(cluster)
        return {
            replica: ours[replica] + self.others(cluster, replica)
            for replica in self.by_replica(self.healthy(cluster))
        }

    def ours_by_replica(self, cluster: str) -> Counter[str]:
        """This picker's requests in flight in the cluster, by replica (one pass)."""
        ours: Counter[str] = Counter()
        for (known, host), count in self.in_flight.items():
            if known == cluster:
                ours[self.replica_of(host)] += count
        return ours

    def others(self, cluster: str, replica: str) -> int:
        reported = self.reports.get((cluster, replica))
        return reported.others if reported is not None and reported.fresh() else 0

    def reported(self, cluster: str, host: str, report: OrcaLoadReport) -> None:
        """A reply of one of this picker's requests ended with `report` (which counts its whole
        replica, every frontend): the replica's requests beyond the ones this picker still has
        in flight there came from others."""
        held = round(
            report.named_metrics["num_requests_running"]
            + report.named_metrics["num_requests_waiting"]
        )
        if not self.count_reports:
            return
        replica = self.replica_of(host)
        ours = self.ours_by_replica(cluster)[replica] - 1  # the ending request is done
        bound = round(report.named_metrics.get("max_num_queued_reqs", 0)) or None
        adapters = frozenset(
            name.removeprefix(ADAPTER_METRIC_PREFIX)
            for name in report.named_metrics
            if name.startswith(ADAPTER_METRIC_PREFIX)
        )
        self.reports[(cluster, replica)] = Reported(max(0, held - ours), held, bound, adapters)

    def holding(self, cluster: str, model: str) -> set[str]:
        """The replicas whose last fresh report holds `model` as an adapter in memory."""
        return {
            replica
            for (known, replica), reported in self.reports.items()
            if known == cluster and model in reported.adapters and reported.fresh()
        }

    def saturated(self, cluster: str, hosts: list[str]) -> bool:
        """Whether the replica of every one of `hosts` reported, lately, holding its backlog
        bound (so that it refuses more)."""

        def full(host: str) -> bool:
            reported = self.reports.get((cluster, self.replica_of(host)))
            return (
                reported is not None
                and reported.fresh()
                and reported.bound is not None
                and reported.held >= reported.bound
            )

        return bool(hosts) and all(full(host) for host in hosts)

    def started(self, cluster: str, host: str) -> None:
        self.in_flight[(cluster, host)] += 1

    def ended(self, cluster: str, host: str) -> None:
        self.in_flight[(cluster, host)] -= 1


@dataclass
class Reported:
    others: int  # requests the replica held that this picker did not send it
    held: int  # all the requests it held (running or waiting)
    bound: int | None  # the backlog bound past which it refuses, if it said
    adapters: frozenset[str] = frozenset()  # the adapters in its engine's memory
    at: float = field(default_factory=time.monotonic)

    def fresh(self) -> bool:
        return time.monotonic() - self.at < REPORT_FRESH_SECONDS
