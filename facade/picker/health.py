"""The replicas' health as a picker shared by several Envoys sees it. No one Envoy's admin speaks
for the others, so the picker checks the replicas itself, the way envoy.yaml has Envoy check
them: each pool's addresses resolved as Envoy resolves them (IPv4 first, every address of a
name), each replica asked grpc.health.v1 at the same pace, taken out at once by a NOT_SERVING
answer or after two checks without one, back in at the first SERVING."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from facade.addresses import Address, resolve
from facade.picker.fleet import Clusters, Replica
from facade.tls import UpstreamTls

# envoy.yaml's health checks: every 2 s, 1 s to answer, out after 2 checks without an answer.
CHECK_EVERY_SECONDS = 2.0
CHECK_TIMEOUT_SECONDS = 1.0
UNANSWERED_LIMIT = 2
# Envoy re-resolves a name every 5 s (its dns_refresh_rate default).
RESOLVE_EVERY_SECONDS = 5.0
SERVING = health_pb2.HealthCheckResponse.SERVING
logger = logging.getLogger("facade.picker")
# A channel to a replica that went away retries its connection at most this often (gRPC's
# default backs off to 2 minutes), and each check waits up to its timeout for it: a replica
# back from a restart is in at the first check after it answers, as Envoy's checks find it.
# Half the timeout: gRPC adds up to 20 % jitter to a backoff, and a retry must fall inside.
RECONNECT = [
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", int(CHECK_TIMEOUT_SECONDS * 500)),
]


@dataclass
class ReplicaChecks:
    """Every pool's replicas (cluster -> configured addresses), resolved and checked."""

    pools: Mapping[str, Sequence[Address]]
    tls: UpstreamTls | None = None
    hosts: dict[str, dict[str, str]] = field(default_factory=dict)  # cluster -> host -> name
    healthy: dict[str, bool] = field(default_factory=dict)  # host -> its last verdict
    unanswered: Counter[str] = field(default_factory=Counter)
    channels: dict[str, grpc.aio.Channel] = field(default_factory=dict)
    next_resolve: float = 0.0
    resolved: dict[Address, list[str]] = field(default_factory=dict)  # each name's last answer
    unresolved: set[Address] = field(default_factory=set)  # names that resolve to nothing now

    async def read(self) -> Clusters:
        """Each cluster's replicas with their health now: names resolved again when due, then
        every replica checked once."""
        if time.monotonic() >= self.next_resolve:
            await self.resolve()
            self.next_resolve = time.monotonic() + RESOLVE_EVERY_SECONDS
        return await self.check_all()

    async def resolve(self) -> None:
        """Each cluster's replicas now. A name that fails to resolve keeps its last answer (as
        Envoy's STRICT_DNS does); a replica no longer resolved is dropped."""
        addresses = list(dict.fromkeys(a for pool in self.pools.values() for a in pool))
        answers = await asyncio.gather(*(asyncio.to_thread(resolve, a) for a in addresses))
        for address, hosts in zip(addresses, answers, strict=True):
            self.note_resolved(address, hosts)
            if hosts:
                self.resolved[address] = hosts
        self.hosts = {
            cluster: {
                host: address[0] for address in pool for host in self.resolved.get(address, [])
            }
            for cluster, pool in self.pools.items()
        }
        current = {host for hosts in self.hosts.values() for host in hosts}
        for host in set(self.channels) - current:
            await self.channels.pop(host).close()
            self.healthy.pop(host, None)
            self.unanswered.pop(host, None)

    def note_resolved(self, address: Address, hosts: list[str]) -> None:
        """One line when a name stops or starts resolving."""
        name = f"{address[0]}:{address[1]}"
        if not hosts and address not in self.unresolved:
            self.unresolved.add(address)
            last = self.resolved.get(address)
            if last:
                logger.warning(
                    "%s resolves to no address now; the picker keeps its last replicas (%s)",
                    name,
                    ", ".join(last),
                )
            else:
                logger.warning(
                    "%s resolves to no address yet; Envoy hashes its requests until it does", name
                )
        elif hosts and address in self.unresolved:
            self.unresolved.discard(address)
            logger.info("%s resolves to %s", name, ", ".join(hosts))

    def channel(self, host: str, name: str) -> grpc.aio.Channel:
        if host not in self.channels:
            if self.tls is None:
                self.channels[host] = grpc.aio.insecure_channel(host, RECONNECT)
            else:  # the certificate names the configured host, not the address it resolved to
                self.channels[host] = grpc.aio.secure_channel(
                    host,
                    self.tls.channel_credentials(),
                    options=[*RECONNECT, ("grpc.ssl_target_name_override", name)],
                )
        return self.channels[host]

    async def check(self, host: str, name: str) -> None:
        stub = health_pb2_grpc.HealthStub(self.channel(host, name))
        try:
            answer = await stub.Check(
                health_pb2.HealthCheckRequest(), timeout=CHECK_TIMEOUT_SECONDS, wait_for_ready=True
            )
        except grpc.RpcError as error:
            if self.unanswered[host] == 0:  # one line per run of failures
                logger.warning(
                    "health check of %s got no answer (%s: %s); out after %d in a row",
                    host,
                    error.code().name,
                    error.details(),
                    UNANSWERED_LIMIT,
                )
            self.unanswered[host] += 1
            if self.unanswered[host] >= UNANSWERED_LIMIT:
                self.healthy[host] = False
            return
        if self.unanswered[host]:
            logger.info("health check of %s answered again", host)
        self.unanswered[host] = 0
        self.healthy[host] = answer.status == SERVING

    async def check_all(self) -> Clusters:
        """Every replica checked once; each cluster's replicas with their health."""
        names = {host: name for hosts in self.hosts.values() for host, name in hosts.items()}
        await asyncio.gather(*(self.check(host, name) for host, name in names.items()))
        return {
            cluster: {host: Replica(self.healthy.get(host, False)) for host in hosts}
            for cluster, hosts in self.hosts.items()
        }

    async def close(self) -> None:
        for channel in self.channels.values():
            await channel.close()
        self.channels.clear()
