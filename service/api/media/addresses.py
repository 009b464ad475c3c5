"""Where the media fetcher may connect: the hosts an operator allowed, else only addresses
that are globally routable, so that no caller can point the server at its own network
(loopback, RFC 1918, link-local and cloud metadata, unique-local, and the same behind
IPv4-mapped, NAT64 and 6to4 forms).

A name is resolved once, by the resolver the download's connection uses, and the connection
goes to the addresses that were checked: a name that resolves elsewhere the second time (DNS
rebinding) never gets a second lookup."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable
from dataclasses import dataclass

from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import ThreadedResolver

from service.api.media.refusal import MediaRefusedError

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
# IPv6 prefixes that carry an IPv4 address in their last 32 bits (NAT64's well-known and
# local-use prefixes): the IPv4 address is the one reached.
NAT64_PREFIXES = (
    ipaddress.IPv6Network("64:ff9b::/96"),
    ipaddress.IPv6Network("64:ff9b:1::/48"),
)


def normalized_host(host: str) -> str:
    """A host as the allowlist compares it: lower case, without brackets or a final dot."""
    return host.strip("[]").rstrip(".").lower()


@dataclass(frozen=True)
class HostRules:
    """The operator's choice: the only hosts URLs may name (exact names, exempt from the
    address check), or None for any host at a public address."""

    allowed_hosts: frozenset[str] | None = None

    @classmethod
    def from_domains(cls, domains: Iterable[str] | None) -> HostRules:
        if not domains:
            return cls(None)
        return cls(frozenset(normalized_host(domain) for domain in domains))

    def check_host(self, host: str) -> None:
        """Refuse a host off the allowlist, or an address literal that is not public."""
        name = normalized_host(host)
        if self.allowed_hosts is not None:
            if name not in self.allowed_hosts:
                allowed = ", ".join(sorted(self.allowed_hosts))
                raise MediaRefusedError(
                    f"images are fetched only from {allowed} (the server's "
                    f"--allowed-media-domains); {name!r} is not one of them: send the image "
                    "inline as a data: URL, or from an allowed host"
                )
            return
        literal = address_literal(name)
        if literal is not None:
            check_public(literal, name)

    def exempt(self, host: str) -> bool:
        """Whether the host's addresses go unchecked: the operator named it."""
        return self.allowed_hosts is not None and normalized_host(host) in self.allowed_hosts


def address_literal(host: str) -> IpAddress | None:
    """The address a host names literally, the shorthand IPv4 forms too (127.1, 2130706433,
    0177.0.0.1), which the C library's parser takes as addresses."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    try:
        return ipaddress.IPv4Address(socket.inet_aton(host))
    except OSError:
        return None


def reached_address(address: IpAddress) -> IpAddress:
    """The IPv4 address behind an IPv6 form that carries one, else the address itself."""
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return address.ipv4_mapped
        if address.sixtofour is not None:
            return address.sixtofour
        if any(address in prefix for prefix in NAT64_PREFIXES) or int(address) >> 32 == 0:
            # NAT64, or the deprecated IPv4-compatible form (::127.0.0.1)
            return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return address


def is_public(address: IpAddress) -> bool:
    reached = reached_address(address)
    site_local = isinstance(reached, ipaddress.IPv6Address) and reached.is_site_local
    return reached.is_global and not (reached.is_multicast or reached.is_unspecified or site_local)


def check_public(address: IpAddress, host: str) -> None:
    if not is_public(address):
        shown = host if host == str(address) else f"{host} ({address})"
        raise MediaRefusedError(
            f"images are not fetched from {shown}: not a public address. Send the image "
            "inline as a data: URL; an operator can allow an internal host by name with "
            "--allowed-media-domains"
        )


class PublicOnlyResolver(AbstractResolver):
    """aiohttp's resolver that refuses a name any of whose addresses is not public (unless the
    operator allowed the name): the connection then goes only to addresses checked here."""

    def __init__(self, rules: HostRules) -> None:
        self.rules = rules
        self.resolver = ThreadedResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        try:
            results = await self.resolver.resolve(host, port, family)
        except OSError as error:
            raise MediaRefusedError(
                f"the image's host {host!r} could not be resolved: {error.strerror or error}"
            ) from error
        if not self.rules.exempt(host):
            for result in results:
                check_public(ipaddress.ip_address(result["host"]), host)
        return results

    async def close(self) -> None:
        await self.resolver.close()
