"""Which replica a keyed completion goes to: the one whose prefix cache holds its key, within a
load bound.

A key is remembered with the replicas it was sent to. A request goes to the least loaded of them
while that one stays within the bound; past the bound it spills to the least loaded replica,
which then holds the key too (a hot prefix ends up on several replicas). A key seen for the first
time goes to the replica holding the fewest keys: the keys, and so the prefixes the replicas'
caches must hold, are dealt out evenly, where hashing them would leave one replica with more
than its share (with two replicas, two keys land on the same one half of the time).
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from collections.abc import Mapping

# Keys remembered per picker; the least recently used are forgotten first. A replica's cache
# holds far fewer prefixes than this.
DEFAULT_MAX_KEYS = 100_000


def load_bound(loads: Mapping[str, int], balance_factor: int) -> int:
    """Most requests in flight a replica may have after taking one more: `balance_factor`
    percent of the average, as Envoy's bounded-load hashing counts it."""
    total = sum(loads.values()) + 1
    return math.ceil(balance_factor * total / (100 * len(loads)))


class CacheAwarePolicy:
    def __init__(self, balance_factor: int, max_keys: int = DEFAULT_MAX_KEYS) -> None:
        self.balance_factor = balance_factor
        self.max_keys = max_keys
        # (cluster, key) -> the replicas that were sent the key.
        self.holders: OrderedDict[tuple[str, str], list[str]] = OrderedDict()
        self.keys_held: Counter[tuple[str, str]] = Counter()  # (cluster, host) -> keys

    def choose(self, cluster: str, key: str, loads: Mapping[str, int]) -> list[str]:
        """The cluster's healthy replicas (HOST:PORT -> requests in flight) in the order to try
        them: the pick first, then the others, least loaded first, for retries. None when the
        cluster has no healthy replica (Envoy's own balancing then decides)."""
        if not loads:
            return []
        bound = load_bound(loads, self.balance_factor)
        holders = [host for host in self.holders.get((cluster, key), []) if host in loads]
        within = [host for host in holders if loads[host] + 1 <= bound]
        if within:
            chosen = min(within, key=lambda host: loads[host])
        elif holders:
            chosen = min(loads, key=lambda host: loads[host])
        else:
            chosen = min(
                loads,
                key=lambda host: (
                    loads[host] + 1 > bound,
                    self.keys_held[(cluster, host)],
                    loads[host],
                ),
            )
        self.remember(cluster, key, chosen)
        others = sorted((host for host in loads if host != chosen), key=lambda host: loads[host])
        return [chosen, *others]

    def remember(self, cluster: str, key: str, host: str) -> None:
        holders = self.holders.setdefault((cluster, key), [])
        self.holders.move_to_end((cluster, key))
        if host not in holders:
            holders.append(host)
            self.keys_held[(cluster, host)] += 1
        while len(self.holders) > self.max_keys:
            (old_cluster, _), old_holders = self.holders.popitem(last=False)
            for old_host in old_holders:
                self.keys_held[(old_cluster, old_host)] -= 1

    def forget_replica(self, cluster: str, host: str) -> None:
        """A replica left (drained, failed, restarted): its cache is gone or will be cold."""
        for (key_cluster, _), holders in self.holders.items():
            if key_cluster == cluster and host in holders:
                holders.remove(host)
        self.keys_held.pop((cluster, host), None)
