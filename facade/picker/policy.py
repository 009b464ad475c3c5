"""Which replica a keyed completion goes to: the one whose prefix cache holds the most of its
prompt, within a load bound.

A prompt comes with its path: digests of its leading part at growing depths (facade/
routing.lua), so that the picker can tell how much of it an earlier prompt shared, and where
that prompt went, without seeing the prompt. A prompt follows the deepest key already known if
that covers at least half of it: a document before a question, a conversation before its next
turn. Otherwise the prompt is mostly new and starts a new branch: instructions that every
prompt begins with, followed by a document of its own, do not pull all the documents onto the
replica that saw the instructions first.

A new branch gets a home: the replica that is home to the fewest branches, so that the
prefixes the replicas' caches must hold are dealt out evenly (hashing them would leave one
replica with more than its share: with two replicas, two land on the same one half of the
time); a new branch of a LoRA adapter's prompts goes first to a replica whose engine holds the
adapter (its load reports say which), so that an adapter lives on few replicas and spreads
only as its load needs.

A branch's requests then go home while home stays within the load bound, as Envoy's
bounded-load hashing counts it; past the bound they spill, first to the replicas the key
spilled to before (their caches may still hold it), else to the least loaded one, which is
remembered for the next spill. A spill is temporary: the next request goes home again if home
has room, so a prefix stays cached in one place and a hot one spreads only as far as its load
needs.

This is the rule of the cache-aware routers of SGLang and vLLM's router (follow the longest
match above a share of the prompt, else the replica with the least cached), with the match read
from digests instead of a tree of the prompts' text.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from collections.abc import Mapping, Set
from dataclasses import dataclass, field

# Keys remembered per picker (at most 25 per prompt); the least recently used are forgotten
# first. A replica's cache holds far fewer prefixes than this.
DEFAULT_MAX_KEYS = 200_000
# A prompt follows the deepest known key if that covers at least this share of it. The routers
# above follow from 0.3 of an exact match, which would send all prompts whose instructions are
# a third of them to one replica (until their load thresholds step in). The deepest known key
# covers at least two thirds of the part shared (its levels grow by at most 1.5 times): a
# prompt that shares three quarters with an earlier one always follows it, one that shares
# less than half never does.
FOLLOW_SHARE = 0.5


def level_depth(base: int, level: int) -> int:
    """Units a path's key covers at each level: base, 1.5 base, 2 base, 3 base, 4 base, ..."""
    doubled = base << (level // 2)
    return doubled if level % 2 == 0 else doubled * 3 // 2


@dataclass(frozen=True)
class PromptPath:
    """A prompt's keys, shallow to deep: keys[i] is a digest of its first
    min(level_depth(base, i), length) units (bytes of text, or token ids)."""

    base: int
    length: int
    keys: tuple[str, ...]

    def depth(self, level: int) -> int:
        return min(level_depth(self.base, level), self.length)

    def covered(self) -> int:
        """The units its keys cover: the whole prompt, unless it is longer than the deepest
        level routing.lua computes."""
        return self.depth(len(self.keys) - 1)

    @classmethod
    def parse(cls, value: str) -> PromptPath | None:
        """From its header, "BASE LENGTH KEY...", or None if that is malformed."""
        parts = value.split()
        if len(parts) < 3 or not (parts[0].isdigit() and parts[1].isdigit()):
            return None
        base, length = int(parts[0]), int(parts[1])
        if base < 1 or length < 1:
            return None
        return cls(base, length, tuple(parts[2:]))


@dataclass
class KeyRecord:
    """The replicas that were sent a key: its home first, then where it spilled, in order."""

    holders: list[str] = field(default_factory=list)
    branch: bool = False  # the key a branch starts at, counted in its home's `homes`


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
        self.keys: OrderedDict[tuple[str, str], KeyRecord] = OrderedDict()  # (cluster, key)
        self.homes: Counter[tuple[str, str]] = Counter()  # (cluster, host) -> branches at home
        self.decisions: Counter[str] = Counter()  # home, spilled, new branch: for the log

    def choose(
        self,
        cluster: str,
        path: PromptPath,
        loads: Mapping[str, int],
        holding: Set[str] = frozenset(),
    ) -> list[str]:
        """The cluster's healthy replicas (HOST:PORT -> requests in flight) in the order to try
        them: the pick first, then the others, least loaded first, for retries. None when the
        cluster has no healthy replica (Envoy's own balancing then decides). A new branch of an
        adapter's prompts goes to a replica `holding` the adapter in memory while one is within
        the bound."""
        if not loads:
            return []
        bound = load_bound(loads, self.balance_factor)
        level, holders = self.deepest_known(cluster, path, loads)
        if holders and path.depth(level) >= FOLLOW_SHARE * path.covered():
            chosen = self.follow(holders, loads, bound)
            branch_level = None
        else:
            chosen = self.new_branch_home(cluster, loads, bound, holding)
            branch_level = level + 1 if holders else 0
        for index, key in enumerate(path.keys):
            self.remember(cluster, key, chosen, branch=index == branch_level)
        others = sorted((host for host in loads if host != chosen), key=lambda host: loads[host])
        return [chosen, *others]

    def deepest_known(
        self, cluster: str, path: PromptPath, loads: Mapping[str, int]
    ) -> tuple[int, list[str]]:
        """The deepest level of the path some healthy replica was sent, and those replicas
        (home first); (-1, []) if none."""
        for level in range(len(path.keys) - 1, -1, -1):
            record = self.keys.get((cluster, path.keys[level]))
            holders = [host for host in record.holders if host in loads] if record else []
            if holders:
                return level, holders
        return -1, []

    def follow(self, holders: list[str], loads: Mapping[str, int], bound: int) -> str:
        within = [host for host in holders if loads[host] <= bound]
        if within:
            self.decisions["home" if within[0] == holders[0] else "spilled"] += 1
            return within[0]
        self.decisions["spilled"] += 1
        return min(loads, key=lambda host: loads[host])

    def new_branch_home(
        self, cluster: str, loads: Mapping[str, int], bound: int, holding: Set[str] = frozenset()
    ) -> str:
        self.decisions["new branch"] += 1
        return min(
            loads,
            key=lambda host: (
                loads[host] > bound,
                host not in holding,
                self.homes[(cluster, host)],
                loads[host],
            ),
        )

    def remember(self, cluster: str, key: str, host: str, branch: bool = False) -> None:
        record = self.keys.setdefault((cluster, key), KeyRecord())
        self.keys.move_to_end((cluster, key))
        if host not in record.holders:
            if not record.holders and branch:
                record.branch = True
                self.homes[(cluster, host)] += 1
            record.holders.append(host)
        while len(self.keys) > self.max_keys:
            (old_cluster, _), old = self.keys.popitem(last=False)
            if old.branch and old.holders:
                self.homes[(old_cluster, old.holders[0])] -= 1

    def forget_replica(self, cluster: str, host: str) -> None:
        """A replica left (drained, failed, restarted): its cache is gone or will be cold. Its
        keys' next holders become their homes."""
        for (key_cluster, _), record in self.keys.items():
            if key_cluster == cluster and host in record.holders:
                if record.branch and record.holders[0] == host and len(record.holders) > 1:
                    self.homes[(cluster, record.holders[1])] += 1
                record.holders.remove(host)
        self.homes.pop((cluster, host), None)
