"""Addresses of replicas and of the picker: HOST:PORT read from the command line (a replica
with several frontend processes as HOST:PORT+PORT...), an IP told from a name, a name resolved
to the replicas Envoy sees behind it, named as Envoy names them, and which of those are one
replica's frontends."""

from __future__ import annotations

import argparse
import ipaddress
import socket
from collections.abc import Iterable
from dataclasses import dataclass

Address = tuple[str, int]
Frontends = tuple[Address, ...]  # one replica: its frontend processes' addresses


def parse_address(text: str) -> Address:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def parse_replica(text: str) -> Frontends:
    """HOST:PORT, or HOST:PORT+PORT... for a replica running several frontend processes over
    one engine (API_SERVER_COUNT > 1), each on its own port."""
    host, _, ports = text.rpartition(":")
    if not host or not all(number.isdigit() for number in ports.split("+")):
        raise argparse.ArgumentTypeError(f"expected HOST:PORT or HOST:PORT+PORT..., got {text!r}")
    return tuple((host, port) for port in parse_frontend_ports(ports))


def parse_frontend_ports(text: str) -> tuple[int, ...]:
    """PORT+PORT...: one replica's frontends' ports, as parse_replica reads them after HOST:."""
    numbers = text.split("+")
    if not all(number.isdigit() for number in numbers):
        raise argparse.ArgumentTypeError(f"expected PORT or PORT+PORT..., got {text!r}")
    if len(set(numbers)) != len(numbers):
        raise argparse.ArgumentTypeError(f"{text!r} lists a port twice")
    return tuple(int(number) for number in numbers)


def frontend_port_sets(replicas: Iterable[Frontends]) -> tuple[tuple[int, ...], ...]:
    """The ports of each replica that runs several frontends."""
    return tuple(tuple(port for _, port in one) for one in replicas if len(one) > 1)


@dataclass(frozen=True)
class FrontendGroups:
    """Which of Envoy's endpoints (IP:PORT) are the frontends of one replica, sharing one
    engine and its cache: those on one IP whose ports an --upstream HOST:PORT+PORT... listed
    together. A replica is named by its first frontend's endpoint; any other endpoint is a
    replica of its own."""

    port_sets: tuple[tuple[int, ...], ...] = ()

    def replica_of(self, endpoint: str) -> str:
        ip, _, port = endpoint.rpartition(":")
        if port.isdigit():
            for ports in self.port_sets:
                if int(port) in ports:
                    return f"{ip}:{ports[0]}"
        return endpoint

    def names_a_replica(self, port: int) -> bool:
        """Whether an endpoint on `port` names its replica (its first frontend, or its only)."""
        return all(port not in ports or port == ports[0] for ports in self.port_sets)


def canonical_ip(host: str) -> str | None:
    """`host` as Envoy writes an IP (::1, not 0:0::1); None for a name."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return None


def is_ip_address(host: str) -> bool:
    return canonical_ip(host) is not None


def host_name(ip: str, port: int) -> str:
    """A replica as Envoy names it (its admin, its override-host header): IP:PORT, [IPv6]:PORT."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def resolve(address: Address) -> list[str]:
    """The replicas an address stands for: itself if it is an IP, else every address its name
    resolves to, IPv4 first (the replica clusters' dns_lookup_family); [] if it resolves to
    none for now."""
    host, port = address
    ip = canonical_ip(host)
    if ip is not None:
        return [host_name(ip, port)]
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            found = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM)
        except socket.gaierror:
            continue
        return sorted({host_name(str(info[4][0]), port) for info in found})
    return []
