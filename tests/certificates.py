"""Certificates made for a test: a private CA, server certificates for loopback, client
certificates, written as PEM files."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID_FOR = datetime.timedelta(days=1)


@dataclass(frozen=True)
class KeyPair:
    cert_file: Path
    key_file: Path


def name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def write_pem(path: Path, certificate: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
    path.with_suffix(".crt").write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    path.with_suffix(".key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


class CertificateAuthority:
    """A CA that signs server and client certificates into `directory`."""

    def __init__(self, directory: Path, common_name: str = "llm-completions test CA") -> None:
        self.directory = directory
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.name = name(common_name)
        now = datetime.datetime.now(datetime.timezone.utc)
        self.certificate = (
            x509.CertificateBuilder()
            .subject_name(self.name)
            .issuer_name(self.name)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + VALID_FOR)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )
        self.cert_file = directory / f"{common_name.replace(' ', '-')}.crt"
        self.cert_file.write_bytes(self.certificate.public_bytes(serialization.Encoding.PEM))

    def issue(
        self,
        file_stem: str,
        common_name: str,
        server: bool,
        by_ip: bool = True,
        dns_name: str = "localhost",
    ) -> KeyPair:
        """A certificate for a server on loopback (`dns_name`, and 127.0.0.1 unless not
        `by_ip`) or a client."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        builder = (
            x509.CertificateBuilder()
            .subject_name(name(common_name))
            .issuer_name(self.name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + VALID_FOR)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
        )
        if server:
            builder = builder.add_extension(
                x509.SubjectAlternativeName(
                    [
                        x509.DNSName(dns_name),
                        *([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))] if by_ip else []),
                    ]
                ),
                critical=False,
            )
        path = self.directory / file_stem
        write_pem(path, builder.sign(self.key, hashes.SHA256()), key)
        return KeyPair(path.with_suffix(".crt"), path.with_suffix(".key"))

    def server(
        self, file_stem: str = "server", by_ip: bool = True, dns_name: str = "localhost"
    ) -> KeyPair:
        return self.issue(file_stem, "llm-completions replica", True, by_ip, dns_name)

    def client(self, file_stem: str = "client") -> KeyPair:
        return self.issue(file_stem, "llm-completions caller", server=False)
