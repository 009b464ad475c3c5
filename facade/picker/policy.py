"""Which replica a keyed completion goes to: the one whose prefix cache holds its key, within a
load bound.

A key seen for the first time gets a home: the replica that is home to the fewest keys, so that
the keys, and the prefixes the replicas' caches must hold, are dealt out evenly (hashing them
would leave one replica with more than its share: with two replicas, two keys land on the same
one half of the time). The key's requests then go home while home stays within the load bound,
as Envoy's bounded-load hashing counts it; past the bound they spill, first to the replicas the
key spilled to before (their caches may still hold it), else to the least loaded one, which is
remembered for the next spill. A spill is temporary: the next request goes home again if home
has room, so a key's prefix stays cached in one place and a hot key spreads only as far as
its load needs.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from collections.abc import Mapping

# Keys remembered per picker; the least recently used are forgotten first. A replica's cache
# holds far fewer prefixes than this.
DEFAULT_MAX_KEYS = 100_000


def load_bound(loads: Mapping[str, int], balance_factor: int) -> int:
    """Most requests in flight a replica may have and still take one more, as Envoy's
    bounded-load hashing counts it: its share of `balance_factor` percent of all requests in
    flight plus this one, rounded up twice."""
    slots = math.ceil((sum(loads.values()) + 1) * balance_factor / 100)
    return math.ceil(slots / len(loads))


class CacheAwarePolicy:
    def __init__(self, balance_factor: int, max_keys: int = DEFAULT_MAX_KEYS) -> None:
        self.balance_factor = balance_factor
        self.max_keys = max_keys
        # (cluster, key) -> the replicas that were sent the key: its home first, then where it
        # spilled, in order.
        self.holders: OrderedDict[tuple[str, str], list[str]] = OrderedDict()
        self.homes: Counter[tuple[str, str]] = Counter()  # (cluster, host) -> keys at home
        self.decisions: Counter[str] = Counter()  # home, spilled, new key: for the log

    def choose(self, cluster: str, key: str, loads: Mapping[str, int]) -> list[str]:
        """The cluster's healthy replicas (HOST:PORT -> requests in flight) in the order to try
        them: the pick first, then the others, least loaded first, for retries. None when the
        cluster has no healthy replica (Envoy's own balancing then decides)."""
        if not loads:
            return []
        bound = load_bound(loads, self.balance_factor)
        holders = [host for host in self.holders.get((cluster, key), []) if host in loads]
        within = [host for host in holders if loads[host] <= bound]
        if within:
            chosen = within[0]
            self.decisions["home" if chosen == holders[0] else "spilled"] += 1
        elif holders:
            chosen = min(loads, key=lambda host: loads[host])
            self.decisions["spilled"] += 1
        else:
            self.decisions["new key"] += 1
            chosen = min(
                loads,
                key=lambda host: (
                    loads[host] > bound,
                    self.homes[(cluster, host)],
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
            if not holders:
                self.homes[(cluster, host)] += 1
            holders.append(host)
        while len(self.holders) > self.max_keys:
            (old_cluster, _), old_holders = self.holders.popitem(last=False)
            if old_holders:
                self.homes[(old_cluster, old_holders[0])] -= 1

    def forget_replica(self, cluster: str, host: str) -> None:
        """A replica left (drained, failed, restarted): its cache is gone or will be cold. Its
        keys' next holders become their homes."""
        for (key_cluster, _), holders in self.holders.items():
            if key_cluster == cluster and host in holders:
                if holders[0] == host and len(holders) > 1:
                    self.homes[(cluster, holders[1])] += 1
                holders.remove(host)
        self.homes.pop((cluster, host), None)
