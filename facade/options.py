"""The facade's command line: every option of `python -m facade.launch`, each with the
environment variable that sets it."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from facade.addresses import FrontendGroups, frontend_port_sets, parse_address, parse_replica
from facade.balancing import BALANCE_POLICIES, PrefixAffinity
from facade.pools import Pool, PoolError, parse_pool, parse_pool_adapters, with_adapter_patterns
from facade.render import (
    DEFAULT_ADMIN_PORT,
    DEFAULT_HTTP_PORT,
    DEFAULT_MAX_REPLY_BYTES,
    DEFAULT_MAX_REQUEST_BYTES,
)
from facade.tls import UpstreamTls, upstream_tls
from plumbing.options import add_option, add_switch, at_least, one_of
from plumbing.ports import DEFAULT_GRPC_PORT
from plumbing.tracing import add_tracing_option

DEFAULT_DISCOVERY_TIMEOUT = 1800.0  # pools may still be loading large models
positive_int = at_least(1)
# Envoy's lowest load bound: no replica above the average.
balance_factor = at_least(100)


@dataclass
class Fleet:
    """The replicas behind Envoy: one pool of `upstreams`, or several `pools` routed by model."""

    upstreams: list[tuple[str, int]]  # every frontend of every replica
    pools: list[Pool] = field(default_factory=list)
    listing: str = ""  # every pool's models, for the calls no pool owns
    frontend_ports: tuple[tuple[int, ...], ...] = ()  # of --upstream replicas with several

    @property
    def frontends(self) -> FrontendGroups:
        """Which endpoints are one replica's frontends, in any pool."""
        pools = (ports for pool in self.pools for ports in pool.frontend_ports)
        return FrontendGroups((*self.frontend_ports, *pools))

    @property
    def groups(self) -> list[list[tuple[str, int]]]:
        """Each pool's replicas, a replica with several frontends once (as its first)."""
        frontends = self.frontends
        return [
            [(host, port) for host, port in group if frontends.names_a_replica(port)]
            for group in [list(pool.addresses) for pool in self.pools] or [self.upstreams]
        ]


def fleet_from(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Fleet:
    """The replicas named on the command line, or by POOLS and GRPC_PORT."""
    try:
        pools = args.pool or [parse_pool(text) for text in os.environ.get("POOLS", "").split()]
        grpc_port = os.environ.get("GRPC_PORT") or DEFAULT_GRPC_PORT
        replicas = args.upstream or [parse_replica(f"127.0.0.1:{grpc_port}")]
    except argparse.ArgumentTypeError as error:
        parser.error(f"POOLS or GRPC_PORT: {error}")
    if pools and args.upstream:
        parser.error("give either --upstream (one pool) or --pool (several), not both")
    try:
        adapters = args.pool_adapters or [
            parse_pool_adapters(text) for text in os.environ.get("POOL_ADAPTERS", "").split()
        ]
        pools = with_adapter_patterns(pools, adapters)
    except (argparse.ArgumentTypeError, PoolError) as error:
        parser.error(f"--pool-adapters or POOL_ADAPTERS: {error}")
    upstreams = [address for replica in replicas for address in replica]
    return Fleet(upstreams, pools, frontend_ports=frontend_port_sets(replicas))


def upstream_tls_from(
    args: argparse.Namespace,
    parser: argparse.ArgumentParser,
    to: Literal["upstream", "picker"] = "upstream",
) -> UpstreamTls | None:
    """TLS to the replicas (--upstream-ca-file and the rest) or to the shared picker
    (--picker-ca-file and the rest), or None for plaintext."""
    files = (getattr(args, f"{to}_{kind}_file") for kind in ("ca", "cert", "key"))
    try:
        return upstream_tls(*files, flag_prefix=f"--{to}")
    except argparse.ArgumentTypeError as error:
        parser.error(str(error))


def add_listener_options(parser: argparse.ArgumentParser) -> None:
    add_option(parser, "--http-port", "HTTP_PORT", DEFAULT_HTTP_PORT, "the REST and gRPC port", int)
    add_option(
        parser, "--admin-port", "ENVOY_ADMIN_PORT", DEFAULT_ADMIN_PORT, "Envoy's admin port", int
    )
    add_option(
        parser,
        "--listen-host",
        "LISTEN_HOST",
        "127.0.0.1",
        "address the REST listener binds (0.0.0.0 in a container); admin stays on loopback",
    )
    add_option(
        parser,
        "--concurrency",
        "ENVOY_CONCURRENCY",
        None,
        "Envoy worker threads (unset: one per hardware thread)",
        positive_int,
    )
    add_switch(
        parser,
        "--debug-headers",
        "ENVOY_DEBUG_HEADERS",
        "add to REST and gRPC replies the replica that served them (x-upstream-host), its time "
        "(x-upstream-service-time) and what routed them (x-prefix-key, x-prefix-path, "
        "x-replica-picked); they reveal internal addresses",
    )
    parser.add_argument(
        "--log-level",
        default="warning",
        help="Envoy's: trace, debug, info, warning, error, critical",
    )


def add_replica_options(parser: argparse.ArgumentParser) -> None:
    add_replica_address_options(parser)
    add_option(
        parser,
        "--discovery-timeout",
        "DISCOVERY_TIMEOUT",
        DEFAULT_DISCOVERY_TIMEOUT,
        "with --pool: how long to wait for each pool to answer ListModels (seconds)",
        float,
    )


def add_replica_address_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--upstream",
        type=parse_replica,
        action="append",
        help="a replica's gRPC HOST:PORT, or HOST:PORT+PORT... for its frontend processes' own "
        "ports when it runs several (API_SERVER_COUNT): Envoy spreads calls over them and the "
        "picker counts them as one replica; repeat for several replicas (default "
        "127.0.0.1:$GRPC_PORT)",
    )
    parser.add_argument(
        "--pool",
        type=parse_pool,
        action="append",
        help="NAME=REPLICA[,REPLICA...], each as --upstream gives one: replicas serving the "
        "base model NAME (its served name) and its adapters; repeat for each base model, and "
        "each call goes to the pool serving its `model` (env POOLS, space-separated)",
    )
    parser.add_argument(
        "--pool-adapters",
        type=parse_pool_adapters,
        action="append",
        help="NAME=PATTERN[,PATTERN...]: names of adapters pool NAME may gain while it serves "
        "(its adapter root, load calls), each exact or a prefix ending in `*`, e.g. "
        "beta=team-b-*; routed to the pool with no restart (env POOL_ADAPTERS, space-separated)",
    )


def add_limit_options(parser: argparse.ArgumentParser) -> None:
    add_option(
        parser,
        "--max-request-bytes",
        "MAX_REQUEST_BYTES",
        DEFAULT_MAX_REQUEST_BYTES,
        "larger REST request bodies get 413",
        positive_int,
    )
    add_option(
        parser,
        "--max-reply-bytes",
        "MAX_REPLY_BYTES",
        DEFAULT_MAX_REPLY_BYTES,
        "largest whole (non-streamed) JSON reply; a larger one is refused with a 400 that says "
        "to stream it",
        positive_int,
    )


def path_option(parser: argparse.ArgumentParser, flag: str, env: str, help_text: str) -> None:
    add_option(parser, flag, env, None, help_text, Path)


def add_tls_options(parser: argparse.ArgumentParser) -> None:
    add_listener_tls_options(parser)
    add_upstream_tls_options(parser)


def add_listener_tls_options(
    parser: argparse.ArgumentParser, served: str = "REST and native gRPC", env_prefix: str = ""
) -> None:
    """--tls-cert-file, --tls-key-file, --tls-client-ca-file, read from the environment as
    `env_prefix`TLS_CERT_FILE and so on."""
    path_option(
        parser,
        "--tls-cert-file",
        f"{env_prefix}TLS_CERT_FILE",
        f"serve {served} over TLS with this PEM certificate (chain); files renamed into its "
        "directory are loaded without a restart; unset: plaintext",
    )
    path_option(parser, "--tls-key-file", f"{env_prefix}TLS_KEY_FILE", "its PEM private key")
    path_option(
        parser,
        "--tls-client-ca-file",
        f"{env_prefix}TLS_CLIENT_CA_FILE",
        "require callers' certificates signed by these PEM CA certificates (mutual TLS)",
    )


def add_upstream_tls_options(parser: argparse.ArgumentParser) -> None:
    path_option(
        parser,
        "--upstream-ca-file",
        "UPSTREAM_CA_FILE",
        "reach the replicas over TLS, trusting the CA certificates in this PEM file; unset: "
        "plaintext",
    )
    path_option(
        parser,
        "--upstream-cert-file",
        "UPSTREAM_CERT_FILE",
        "the PEM client certificate Envoy presents to replicas that require one",
    )
    path_option(parser, "--upstream-key-file", "UPSTREAM_KEY_FILE", "its PEM private key")


def add_balance_options(parser: argparse.ArgumentParser) -> None:
    defaults = PrefixAffinity()
    add_option(
        parser,
        "--balance",
        "BALANCE",
        "prefix",
        "how a pool's replica is picked for a completion: prefix (the replica picker sends a "
        "prompt to the replica that was sent at least half of it before, within a load bound, "
        "and deals mostly new prompts out evenly), prefix-hash (Envoy hashes one key, the model "
        "and the prompt's leading part, with the same bound) or least-request",
        one_of(*BALANCE_POLICIES),
    )
    add_option(
        parser,
        "--prefix-chars",
        "PREFIX_CHARS",
        defaults.chars,
        "the leading part of a text prompt that keys it for Envoy's hashing (prefix-hash, and "
        "prefix without its picker), in bytes",
        positive_int,
    )
    add_option(
        parser,
        "--prefix-tokens",
        "PREFIX_TOKENS",
        defaults.tokens,
        "the same for a token-id prompt, in ids",
        positive_int,
    )
    add_balance_factor_option(parser)


def add_balance_factor_option(parser: argparse.ArgumentParser) -> None:
    add_option(
        parser,
        "--balance-factor",
        "BALANCE_FACTOR",
        PrefixAffinity().balance_factor,
        "a replica takes a prefix's requests while its requests in flight are within this "
        "percentage of the pool's average, else the next replica does",
        balance_factor,
    )


def add_picker_option(parser: argparse.ArgumentParser) -> None:
    add_option(
        parser,
        "--picker",
        "PICKER",
        None,
        "with --balance prefix: ask the replica picker at HOST:PORT, one shared by several "
        "Envoys of the pools (python -m facade.picker.server --listen), instead of starting "
        "one beside this Envoy",
        parse_address,
    )
    path_option(
        parser,
        "--picker-ca-file",
        "PICKER_CA_FILE",
        "reach the shared picker over TLS, trusting the CA certificates in this PEM file (its "
        "certificate must name the --picker host); unset: plaintext",
    )
    path_option(
        parser,
        "--picker-cert-file",
        "PICKER_CERT_FILE",
        "the PEM client certificate Envoy presents to a picker that requires one",
    )
    path_option(parser, "--picker-key-file", "PICKER_KEY_FILE", "its PEM private key")


def affinity_from(args: argparse.Namespace) -> PrefixAffinity | None:
    if args.balance == "least-request":
        return None
    picker = args.balance == "prefix"
    return PrefixAffinity(args.prefix_chars, args.prefix_tokens, args.balance_factor, picker)


def build_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    add_listener_options(parser)
    add_replica_options(parser)
    add_limit_options(parser)
    add_tls_options(parser)
    add_balance_options(parser)
    add_picker_option(parser)
    add_tracing_option(parser)
    return parser
