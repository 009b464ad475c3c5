"""Addresses of replicas and of the picker: HOST:PORT read from the command line, an IP told
from a name, and a name resolved to the replicas Envoy sees behind it, named as Envoy names
them."""

from __future__ import annotations

import argparse
import ipaddress
import socket

Address = tuple[str, int]


def parse_address(text: str) -> Address:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


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
