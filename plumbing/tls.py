"""TLS on the gRPC listener, with certificate files that are read again when they change.

grpc asks for the certificate configuration at every new TLS handshake; the files' identity
(inode, size, modification time) is compared with what was last loaded, so a rotation (new
files written in place, or renamed over the old ones as Kubernetes updates a mounted Secret)
takes effect for the next connection without a restart. Connections already open keep the
certificate they were made with. A new set that cannot be loaded (a key that does not match
its certificate, a file half written) is logged and the previous set is kept.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc

logger = logging.getLogger(__name__)

FileIdentity = tuple[tuple[int, int, int], ...]


@dataclass(frozen=True)
class TlsSettings:
    """TLS on the gRPC listener; with a client CA, callers must present a certificate it
    signed (mutual TLS). The files are read again when they change on disk."""

    cert_file: Path
    key_file: Path
    client_ca_file: Path | None = None

    @property
    def mutual(self) -> bool:
        return self.client_ca_file is not None


class CertificateError(ValueError):
    """The certificate files cannot be used; the message says which and why."""


def check_files(settings: TlsSettings) -> None:
    """Refuse a set of files TLS could not be served with, naming the file and the cause."""
    try:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(settings.cert_file, settings.key_file)
    except (OSError, ssl.SSLError) as error:
        raise CertificateError(
            f"cannot use --tls-cert-file {settings.cert_file} with --tls-key-file "
            f"{settings.key_file}: {error} (both PEM; the key must be the certificate's)"
        ) from error
    if settings.client_ca_file is not None:
        try:
            context.load_verify_locations(cafile=settings.client_ca_file)
        except (OSError, ssl.SSLError) as error:
            raise CertificateError(
                f"cannot use --tls-client-ca-file {settings.client_ca_file}: {error} "
                "(PEM certificates of the CAs that sign client certificates)"
            ) from error


def absolute(path: Path) -> Path:
    """The path from the root, links not followed: a mounted Kubernetes Secret links each file
    through `..data` to a directory that the next update replaces, so files are read again, and
    their directory watched (Envoy), by the path given."""
    return path.expanduser().absolute()


def tls_settings(
    cert_file: Path | None, key_file: Path | None, client_ca_file: Path | None
) -> TlsSettings | None:
    """TLS from the three options, with absolute paths and its files checked; None for
    plaintext. The same options, and rules, serve the gRPC listener and Envoy's."""
    if cert_file is None and key_file is None:
        if client_ca_file is not None:
            raise CertificateError("--tls-client-ca-file needs --tls-cert-file and --tls-key-file")
        return None
    if cert_file is None or key_file is None:
        raise CertificateError("--tls-cert-file and --tls-key-file go together: give both")
    settings = TlsSettings(
        absolute(cert_file),
        absolute(key_file),
        None if client_ca_file is None else absolute(client_ca_file),
    )
    check_files(settings)
    return settings


def identity(paths: list[Path]) -> FileIdentity:
    stats = [os.stat(path) for path in paths]
    return tuple((stat.st_ino, stat.st_size, stat.st_mtime_ns) for stat in stats)


class ReloadingCertificates:
    """The certificate configuration for grpc, loaded again when the files change."""

    def __init__(self, settings: TlsSettings) -> None:
        self._settings = settings
        self._paths = [settings.cert_file, settings.key_file]
        if settings.client_ca_file is not None:
            self._paths.append(settings.client_ca_file)
        self._lock = threading.Lock()  # grpc may handshake on several threads
        self._loaded = identity(self._paths)
        self.initial = self._load()

    def _load(self) -> grpc.ServerCertificateConfiguration:
        settings = self._settings
        return grpc.ssl_server_certificate_configuration(
            [(settings.key_file.read_bytes(), settings.cert_file.read_bytes())],
            root_certificates=(
                settings.client_ca_file.read_bytes() if settings.client_ca_file else None
            ),
        )

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """grpc's callback at each handshake: a new configuration, or None for no change."""
        with self._lock:
            try:
                current = identity(self._paths)
                if current == self._loaded:
                    return None
                check_files(self._settings)
                configuration = self._load()
            except (OSError, CertificateError) as error:
                logger.warning("certificate files changed but cannot be used yet: %s", error)
                return None
            self._loaded = current
            logger.info("certificate files changed: new connections use them")
            return configuration


def server_credentials(settings: TlsSettings) -> grpc.ServerCredentials:
    certificates = ReloadingCertificates(settings)
    return grpc.dynamic_ssl_server_credentials(
        certificates.initial,
        certificates.fetch,
        require_client_authentication=settings.client_ca_file is not None,
    )
