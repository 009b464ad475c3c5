"""The transport's configuration without a running server: the keepalive options grpc gets,
certificate files re-read when they change, and Envoy's TLS on its listener, on every
cluster of replicas and to a shared replica picker."""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from facade import envoy_config, render
from facade.balancing import PrefixAffinity
from facade.picker import server as picker_server
from facade.pools import Pool
from facade.tls import UpstreamTls, listener_tls, upstream_tls
from plumbing.keepalive import KeepaliveSettings, server_options
from plumbing.tls import ReloadingCertificates, TlsSettings
from tests.certificates import CertificateAuthority, KeyPair
from tests.processes import clean_environment


def test_the_server_accepts_pings_every_5s_and_never_goaways_them() -> None:
    options = dict(server_options(KeepaliveSettings()))
    assert options["grpc.http2.min_recv_ping_interval_without_data_ms"] == 5000
    assert options["grpc.http2.max_ping_strikes"] == 0  # grpc: 0 bears any number
    assert options["grpc.keepalive_permit_without_calls"] == 1


def test_the_servers_pings_are_answered_within_the_keepalive_timeout() -> None:
    options = dict(server_options(KeepaliveSettings(time_seconds=7, timeout_seconds=3)))
    assert options["grpc.keepalive_time_ms"] == 7000
    # grpc 1.85 closes the connection when a ping is unanswered for ping_timeout_ms.
    assert options["grpc.keepalive_timeout_ms"] == options["grpc.http2.ping_timeout_ms"] == 3000
    assert options["grpc.http2.max_pings_without_data"] == 0


def replace_pair(pair: KeyPair, new: KeyPair) -> None:
    os.replace(new.key_file, pair.key_file)
    os.replace(new.cert_file, pair.cert_file)


def test_certificates_are_loaded_again_only_when_their_files_change(tmp_path: Path) -> None:
    authority = CertificateAuthority(tmp_path)
    pair = authority.server("served")
    certificates = ReloadingCertificates(TlsSettings(pair.cert_file, pair.key_file))
    assert certificates.fetch() is None  # nothing changed
    replace_pair(pair, authority.server("next"))
    assert certificates.fetch() is not None
    assert certificates.fetch() is None


def test_a_mismatched_pair_is_not_loaded_until_it_matches(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    authority = CertificateAuthority(tmp_path)
    pair = authority.server("served")
    certificates = ReloadingCertificates(TlsSettings(pair.cert_file, pair.key_file))
    halfway = authority.server("next")
    os.replace(halfway.cert_file, pair.cert_file)  # the certificate first, the key not yet
    with caplog.at_level(logging.WARNING):
        assert certificates.fetch() is None
    assert "cannot be used yet" in caplog.text
    os.replace(halfway.key_file, pair.key_file)
    assert certificates.fetch() is not None


def pki(tmp_path: Path) -> tuple[CertificateAuthority, KeyPair]:
    authority = CertificateAuthority(tmp_path)
    return authority, authority.server()


def with_tls(tmp_path: Path, pools: bool) -> tuple[dict[str, Any], TlsSettings, UpstreamTls]:
    authority, pair = pki(tmp_path)
    config = render.render_config(8080, 9901, [("127.0.0.1", 50051)])
    two = [Pool(name, (("127.0.0.1", port),), (name,)) for name, port in (("a", 1), ("b", 2))]
    render.configure_routing(config, two if pools else [], "", PrefixAffinity())
    listener = TlsSettings(pair.cert_file, pair.key_file, authority.cert_file)
    upstream = UpstreamTls(authority.cert_file, pair.cert_file, pair.key_file)
    render.apply_tls(config, listener, upstream, tmp_path)
    return config, listener, upstream


@pytest.mark.parametrize("pools", [False, True])
def test_envoy_speaks_tls_on_its_listener_and_to_every_replica(tmp_path: Path, pools: bool) -> None:
    config, _, _ = with_tls(tmp_path, pools)
    chain = config["static_resources"]["listeners"][0]["filter_chains"][0]
    downstream = chain["transport_socket"]["typed_config"]
    assert downstream["require_client_certificate"] is True
    assert downstream["common_tls_context"]["alpn_protocols"] == ["h2", "http/1.1"]
    replicas = [c for c in config["static_resources"]["clusters"] if "load_assignment" in c]
    assert len(replicas) == (4 if pools else 2)  # each pool and its twin balanced by prefix
    for cluster in replicas:
        context = cluster["transport_socket"]["typed_config"]["common_tls_context"]
        assert context["alpn_protocols"] == ["h2"]
        assert "tls_certificate_sds_secret_configs" in context  # Envoy's client certificate
        validation = context["combined_validation_context"]["default_validation_context"]
        ip = {"san_type": "IP_ADDRESS", "matcher": {"exact": "127.0.0.1"}}
        assert validation["match_typed_subject_alt_names"] == [ip]
    aggregate = [c for c in config["static_resources"]["clusters"] if c not in replicas]
    assert all("transport_socket" not in cluster for cluster in aggregate)


def subject_names(cluster: dict[str, Any]) -> list[tuple[str, str]]:
    context = cluster["transport_socket"]["typed_config"]["common_tls_context"]
    validation = context["combined_validation_context"]["default_validation_context"]
    return [
        (m["san_type"], m["matcher"]["exact"]) for m in validation["match_typed_subject_alt_names"]
    ]


def test_a_replicas_certificate_must_name_a_host_of_its_pool(tmp_path: Path) -> None:
    authority, _ = pki(tmp_path)
    addresses = [("replica-a", 1), ("replica-b", 1), ("0:0::5", 1), ("::5", 2), ("replica-a", 2)]
    config = render.render_config(8080, 9901, addresses)
    render.apply_tls(config, None, UpstreamTls(authority.cert_file), tmp_path)
    (cluster,) = envoy_config.replica_clusters(config)
    assert subject_names(cluster) == [
        ("DNS", "replica-a"),
        ("DNS", "replica-b"),
        ("IP_ADDRESS", "::5"),
    ]


def test_each_pool_and_its_twin_name_their_own_hosts(tmp_path: Path) -> None:
    authority, _ = pki(tmp_path)
    config = render.render_config(8080, 9901, [("127.0.0.1", 50051)])
    pools = [Pool("a", (("10.0.0.1", 1),), ("a",)), Pool("b", (("pool-b.test", 1),), ("b",))]
    render.configure_routing(config, pools, "", PrefixAffinity())
    render.apply_tls(config, None, UpstreamTls(authority.cert_file), tmp_path)
    names = {c["name"]: subject_names(c) for c in envoy_config.replica_clusters(config)}
    assert names == {
        "pool_a": [("IP_ADDRESS", "10.0.0.1")],
        "pool_a_prefix": [("IP_ADDRESS", "10.0.0.1")],
        "pool_b": [("DNS", "pool-b.test")],
        "pool_b_prefix": [("DNS", "pool-b.test")],
    }


@pytest.mark.parametrize(
    ("host", "san_type", "san"),
    [
        ("llm-completions-picker", "DNS", "llm-completions-picker"),
        ("127.0.0.1", "IP_ADDRESS", "127.0.0.1"),
        ("0:0::1", "IP_ADDRESS", "::1"),  # as Envoy writes an IP it compares
    ],
)
def test_envoy_reaches_a_shared_picker_over_tls_that_names_its_host(
    tmp_path: Path, host: str, san_type: str, san: str
) -> None:
    authority, pair = pki(tmp_path)
    config = render.render_config(8080, 9901, [("127.0.0.1", 1), ("127.0.0.1", 2)])
    render.configure_routing(config, [], "", PrefixAffinity(), (host, 50061))
    picker_tls = UpstreamTls(authority.cert_file, pair.cert_file, pair.key_file)
    render.apply_tls(config, None, None, tmp_path, (picker_tls, (host, 50061)))
    picker = envoy_config.cluster_named(config, envoy_config.PICKER_CLUSTER)
    typed = picker["transport_socket"]["typed_config"]
    assert typed.get("sni") == (host if san_type == "DNS" else None)
    context = typed["common_tls_context"]
    assert context["alpn_protocols"] == ["h2"]
    validation = context["combined_validation_context"]
    (matcher,) = validation["default_validation_context"]["match_typed_subject_alt_names"]
    assert matcher == {"san_type": san_type, "matcher": {"exact": san}}
    ca = validation["validation_context_sds_secret_config"]["sds_config"]["path_config_source"]
    (sds,) = context["tls_certificate_sds_secret_configs"]
    certificate = sds["sds_config"]["path_config_source"]
    assert {Path(ca["path"]).name, Path(certificate["path"]).name} == {
        "picker_ca.yaml",
        "picker_client_certificate.yaml",
    }
    # TLS to the picker is its own: the replicas stay plaintext unless told otherwise.
    assert all("transport_socket" not in c for c in envoy_config.replica_clusters(config))


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--picker-ca-file", "ca.crt"], {}, "give --picker too"),
        ([], {"PICKER_CA_FILE": "ca.crt"}, "give --picker too"),
        (["--picker", "127.0.0.1:1", "--picker-cert-file", "c.crt"], {}, "need --picker-ca-file"),
        (
            ["--picker", "127.0.0.1:1", "--picker-ca-file", "ca.crt", "--picker-key-file", "c.crt"],
            {},
            "--picker-cert-file and --picker-key-file go together",
        ),
    ],
)
def test_tls_to_a_shared_picker_needs_the_picker_and_its_ca(
    tmp_path: Path, argv: list[str], env: dict[str, str], message: str
) -> None:
    authority, _ = pki(tmp_path)
    for name in ("ca.crt", "c.crt"):
        (tmp_path / name).write_bytes(authority.cert_file.read_bytes())
    result = subprocess.run(
        [sys.executable, "-m", "facade.launch", *argv],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=clean_environment(**env),
        timeout=60,  # a refusal that regressed would start Envoy
    )
    assert result.returncode == 2
    assert message in result.stderr


def test_a_shared_picker_reads_its_own_tls_variables_not_the_services(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("TLS_CERT_FILE", str(tmp_path / "service.crt"))
    assert (
        picker_server.build_parser().parse_args(["--listen", "127.0.0.1:1"]).tls_cert_file is None
    )
    monkeypatch.setenv("PICKER_TLS_CERT_FILE", str(tmp_path / "picker.crt"))
    args = picker_server.build_parser().parse_args(["--listen", "127.0.0.1:1"])
    assert args.tls_cert_file == tmp_path / "picker.crt"


def test_envoy_reads_each_certificate_from_a_watched_secret_file(tmp_path: Path) -> None:
    config, listener, _ = with_tls(tmp_path, pools=False)
    chain = config["static_resources"]["listeners"][0]["filter_chains"][0]
    context = chain["transport_socket"]["typed_config"]["common_tls_context"]
    (sds,) = context["tls_certificate_sds_secret_configs"]
    secret_file = Path(sds["sds_config"]["path_config_source"]["path"])
    (secret,) = yaml.safe_load(secret_file.read_text())["resources"]
    assert secret["name"] == sds["name"]
    certificate = secret["tls_certificate"]
    assert certificate["certificate_chain"]["filename"] == str(listener.cert_file)
    assert certificate["watched_directory"]["path"] == str(listener.cert_file.parent)


def test_envoy_keeps_both_sides_alive_with_http2_pings() -> None:
    config = render.render_config(8080, 9901, [("127.0.0.1", 50051)])
    manager = envoy_config.connection_manager(config)
    assert manager["http2_protocol_options"]["connection_keepalive"]["timeout"]
    (cluster,) = config["static_resources"]["clusters"]
    options = cluster["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ]["explicit_http_config"]["http2_protocol_options"]
    assert options["connection_keepalive"]["interval"]


def test_partial_tls_options_of_the_facade_are_refused(tmp_path: Path) -> None:
    authority, pair = pki(tmp_path)
    with pytest.raises(argparse.ArgumentTypeError, match="go together"):
        listener_tls(pair.cert_file, None, None)
    with pytest.raises(argparse.ArgumentTypeError, match="needs --tls-cert-file"):
        listener_tls(None, None, authority.cert_file)
    with pytest.raises(argparse.ArgumentTypeError, match="need --upstream-ca-file"):
        upstream_tls(None, pair.cert_file, pair.key_file)
    with pytest.raises(argparse.ArgumentTypeError, match="cannot read"):
        upstream_tls(tmp_path / "none.crt", None, None)
    assert listener_tls(None, None, None) is None and upstream_tls(None, None, None) is None
