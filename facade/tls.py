"""TLS on Envoy's two sides: its listener (REST and native gRPC callers) and its connections to
the replicas (health checks included), plus gRPC channels that reach a replica the way Envoy
does (the stack's readiness checks, pool discovery).

The listener takes the service's own options, by the same rules (TlsSettings). Envoy reads
each certificate through a secret in a file of its own (file-based SDS), with the
certificate's directory watched: files renamed into that directory (as Kubernetes updates a
mounted Secret, or `mv new.crt server.crt`) are loaded for new connections without a restart.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import yaml

from facade.addresses import canonical_ip, is_ip_address
from plumbing.tls import CertificateError, TlsSettings, absolute, tls_settings

TLS_SOCKET = "envoy.transport_sockets.tls"
TLS_TYPES = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3."


@dataclass(frozen=True)
class UpstreamTls:
    """Envoy's (and the stack's) connections to the replicas: the CA that signed their
    certificates, and the client certificate to present when replicas require one."""

    ca_file: Path
    cert_file: Path | None = None
    key_file: Path | None = None

    @property
    def mutual(self) -> bool:
        return self.cert_file is not None

    def channel_credentials(self) -> grpc.ChannelCredentials:
        client = (self.key_file, self.cert_file) if self.cert_file and self.key_file else ()
        return grpc.ssl_channel_credentials(
            self.ca_file.read_bytes(), *(path.read_bytes() for path in client)
        )


def describe_tls(tls: TlsSettings | UpstreamTls | None) -> str:
    if tls is None:
        return "plaintext"
    return "mutual TLS" if tls.mutual else "TLS"


def grpc_channel(target: str, tls: UpstreamTls | None) -> grpc.Channel:
    """A channel to a replica: TLS when the replicas serve it, else plaintext."""
    if tls is None:
        return grpc.insecure_channel(target)
    return grpc.secure_channel(target, tls.channel_credentials())


def optional(path: Path | None) -> Path | None:
    return None if path is None else absolute(path)


def listener_tls(
    cert_file: Path | None, key_file: Path | None, client_ca_file: Path | None
) -> TlsSettings | None:
    """Envoy's listener from the three options, as the service reads its own (None:
    plaintext); a usage error for a partial or unusable set."""
    try:
        return tls_settings(cert_file, key_file, client_ca_file)
    except CertificateError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def upstream_tls(
    ca_file: Path | None,
    cert_file: Path | None,
    key_file: Path | None,
    flag_prefix: str = "--upstream",
) -> UpstreamTls | None:
    """From the three options `flag_prefix`-ca-file, -cert-file and -key-file (None: plaintext
    to the replicas, or to the shared picker)."""
    if ca_file is None:
        if cert_file is not None or key_file is not None:
            raise argparse.ArgumentTypeError(
                f"{flag_prefix}-cert-file and {flag_prefix}-key-file need {flag_prefix}-ca-file"
            )
        return None
    if (cert_file is None) != (key_file is None):
        raise argparse.ArgumentTypeError(
            f"{flag_prefix}-cert-file and {flag_prefix}-key-file go together"
        )
    check_readable(ca_file, cert_file, key_file)
    return UpstreamTls(absolute(ca_file), optional(cert_file), optional(key_file))


def check_readable(*paths: Path | None) -> None:
    for path in paths:
        if path is not None and not os.access(path, os.R_OK):
            raise argparse.ArgumentTypeError(f"cannot read {path}")


def upstream_tls_from_env(env: Mapping[str, str]) -> UpstreamTls | None:
    """As facade.launch reads it from its environment (UPSTREAM_CA_FILE, ...)."""

    def path(name: str) -> Path | None:
        value = env.get(name)
        return Path(value) if value else None

    return upstream_tls(
        path("UPSTREAM_CA_FILE"), path("UPSTREAM_CERT_FILE"), path("UPSTREAM_KEY_FILE")
    )


def write_secret(directory: Path, name: str, secret: dict[str, Any]) -> dict[str, Any]:
    """A secret in a file of its own; the SDS config that points Envoy at it."""
    path = directory / f"{name}.yaml"
    resource = {"@type": f"{TLS_TYPES}Secret", "name": name, **secret}
    path.write_text(yaml.safe_dump({"resources": [resource]}, sort_keys=False))
    return {
        "name": name,
        "sds_config": {"path_config_source": {"path": str(path)}, "resource_api_version": "V3"},
    }


def certificate_secret(cert_file: Path, key_file: Path) -> dict[str, Any]:
    return {
        "tls_certificate": {
            "certificate_chain": {"filename": str(cert_file)},
            "private_key": {"filename": str(key_file)},
            "watched_directory": {"path": str(cert_file.parent)},
        }
    }


def ca_secret(ca_file: Path) -> dict[str, Any]:
    return {
        "validation_context": {
            "trusted_ca": {"filename": str(ca_file)},
            "watched_directory": {"path": str(ca_file.parent)},
        }
    }


def listener_transport_socket(tls: TlsSettings, directory: Path) -> dict[str, Any]:
    """TLS for REST (HTTP/1.1 or HTTP/2, by ALPN) and native gRPC callers."""
    context: dict[str, Any] = {
        "alpn_protocols": ["h2", "http/1.1"],
        "tls_certificate_sds_secret_configs": [
            write_secret(
                directory, "listener_certificate", certificate_secret(tls.cert_file, tls.key_file)
            )
        ],
    }
    if tls.client_ca_file is not None:
        context["validation_context_sds_secret_config"] = write_secret(
            directory, "listener_client_ca", ca_secret(tls.client_ca_file)
        )
    return {
        "name": TLS_SOCKET,
        "typed_config": {
            "@type": f"{TLS_TYPES}DownstreamTlsContext",
            "require_client_certificate": tls.client_ca_file is not None,
            "common_tls_context": context,
        },
    }


def san_matchers(hosts: Sequence[str]) -> list[dict[str, Any]]:
    """The subject alternative names that are `hosts`, each once: DNS names, or IPs in the
    canonical text Envoy compares."""
    names = {canonical_ip(host) or host: is_ip_address(host) for host in hosts}
    return [
        {"san_type": "IP_ADDRESS" if ip else "DNS", "matcher": {"exact": name}}
        for name, ip in names.items()
    ]


def upstream_transport_socket(
    tls: UpstreamTls, directory: Path, hosts: Sequence[str], name: str = "upstream"
) -> dict[str, Any]:
    """TLS to the servers of a cluster known by `hosts` (names or IPs), HTTP/2 by ALPN: a
    server's certificate must be signed by the CA and name one of the hosts (a gRPC client
    checks it names the very host it dials; Envoy checks per cluster). Its secrets' files are
    named after `name`."""
    context: dict[str, Any] = {
        "alpn_protocols": ["h2"],
        "combined_validation_context": {
            "default_validation_context": {"match_typed_subject_alt_names": san_matchers(hosts)},
            "validation_context_sds_secret_config": write_secret(
                directory, f"{name}_ca", ca_secret(tls.ca_file)
            ),
        },
    }
    if tls.cert_file is not None and tls.key_file is not None:
        context["tls_certificate_sds_secret_configs"] = [
            write_secret(
                directory,
                f"{name}_client_certificate",
                certificate_secret(tls.cert_file, tls.key_file),
            )
        ]
    return {
        "name": TLS_SOCKET,
        "typed_config": {"@type": f"{TLS_TYPES}UpstreamTlsContext", "common_tls_context": context},
    }


def named_server_transport_socket(
    tls: UpstreamTls, directory: Path, name: str, host: str
) -> dict[str, Any]:
    """TLS to one server known by `host`, whose certificate must name it; a name is also sent
    as SNI."""
    socket = upstream_transport_socket(tls, directory, [host], name)
    if not is_ip_address(host):
        socket["typed_config"]["sni"] = host
    return socket
