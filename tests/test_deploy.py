"""deploy/ agrees with the code: names, ports, probes and options match envoy.yaml and the
command lines of the service, Envoy's launcher and the picker; the certificates name the hosts
their clients dial; the metrics scraped and scaled on are those the service exports. Read from
the manifests as kustomize renders them (`kubectl kustomize`), the way they are applied."""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

import facade.options
import facade.picker.server
from facade.addresses import parse_address, parse_replica
from facade.options import DEFAULT_DISCOVERY_TIMEOUT
from facade.render import ENVOY_TEMPLATE
from service.cli import build_parser
from service.settings import ServerSettings

# From `stopped` to the end of the process, with room to spare (measured: under 0.1 s).
EXIT_SECONDS = 1.0

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
BASES = ("model", "envoy", "policies")
TLS_OVERLAYS = ("", "two-models")  # deploy/ itself is "", with TLS

REPLICAS = "llm-completions"
ENVOY = "llm-completions-envoy"
PICKER = "llm-completions-picker"
# What a container's environment may hold besides its program's options: the pod's namespace
# and the replicas' ports (for $(POD_NAMESPACE) and $(REPLICA_PORTS) in the arguments) and the
# Hugging Face Hub's offline switch.
NOT_OPTIONS = {"POD_NAMESPACE", "REPLICA_PORTS", "HF_HUB_OFFLINE"}
OVERLAYS = tuple(
    "" if path.parent == DEPLOY else path.parent.name
    for path in sorted(DEPLOY.glob("*kustomization.yaml"))
    + sorted(DEPLOY.glob("*/kustomization.yaml"))
    if path.parent.name not in (*BASES, "base", "components")
)

Document = dict[str, Any]


@functools.cache
def rendered(overlay: str = "") -> tuple[Document, ...]:
    if shutil.which("kubectl") is None:
        pytest.skip("reading deploy/ as it is applied needs kubectl (kubectl kustomize)")
    output = subprocess.run(
        ["kubectl", "kustomize", str(DEPLOY / overlay)], capture_output=True, text=True
    )
    assert output.returncode == 0, output.stderr
    return tuple(document for document in yaml.safe_load_all(output.stdout) if document)


def find(kind: str, name: str, overlay: str = "") -> Document:
    matches = [d for d in rendered(overlay) if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name} in deploy/{overlay}"
    return matches[0]


def of_kind(kind: str, overlay: str = "") -> list[Document]:
    return [document for document in rendered(overlay) if document["kind"] == kind]


def replica_deployments(overlay: str = "") -> list[Document]:
    return [d for d in of_kind("Deployment", overlay) if labels(d)["app"] == REPLICAS]


def container(deployment: Document) -> dict[str, Any]:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def labels(deployment: Document) -> dict[str, str]:
    return deployment["spec"]["template"]["metadata"]["labels"]


def env(deployment: Document) -> dict[str, str]:
    """The container's variables with their values as the pod sees them (the namespace for
    a reference to it; a Secret's value as '<secret>')."""
    values = {}
    for item in container(deployment).get("env", []):
        source = item.get("valueFrom", {})
        if "fieldRef" in source:
            assert source["fieldRef"]["fieldPath"] == "metadata.namespace", item
            values[item["name"]] = deployment["metadata"]["namespace"]
        elif "configMapKeyRef" in source:
            reference = source["configMapKeyRef"]
            values[item["name"]] = config_map(reference["name"])["data"][reference["key"]]
        else:
            values[item["name"]] = item.get("value", "<secret>")
    return values


def config_map(name: str) -> Document:
    """A ConfigMap any overlay renders (its name ends in a hash of its data)."""
    found = [
        document
        for overlay in OVERLAYS
        for document in rendered(overlay)
        if document["kind"] == "ConfigMap" and document["metadata"]["name"] == name
    ]
    assert found, f"no overlay renders the ConfigMap {name}"
    return found[0]


def frontend_ports(overlay: str = "") -> tuple[int, ...]:
    """The ports Envoy and the picker reach a replica's frontends on: each frontend's own
    (frontend-N) with API_SERVER_COUNT > 1, else the service's port."""

    def of(replicas: Document) -> tuple[int, ...]:
        count = int(env(replicas).get("API_SERVER_COUNT") or 1)
        if count == 1:
            return (ports(replicas)["grpc"],)
        return tuple(ports(replicas)[f"frontend-{index}"] for index in range(count))

    (same_in_every_pool,) = {of(replicas) for replicas in replica_deployments(overlay)}
    return same_in_every_pool


def arguments(deployment: Document) -> list[str]:
    """The container's arguments as Kubernetes passes them, $(VAR) expanded."""
    variables = env(deployment)
    return [
        re.sub(r"\$\((\w+)\)", lambda match: variables[match.group(1)], argument)
        for argument in container(deployment)["args"]
    ]


def flags(deployment: Document) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for argument in arguments(deployment):
        name, _, value = argument.removeprefix("--").partition("=")
        found.setdefault(name, []).append(value)
    return found


def flag(deployment: Document, name: str) -> str:
    (value,) = flags(deployment)[name]
    return value


def ports(deployment: Document) -> dict[str, int]:
    return {port["name"]: port["containerPort"] for port in container(deployment)["ports"]}


def service_defaults() -> Any:
    return build_parser().parse_args(["serve"])


def probe_port(probe: dict[str, Any]) -> int:
    """The port a probe asks: the kubelet's own gRPC probe, or the TLS probe script's."""
    if "grpc" in probe:
        return int(probe["grpc"]["port"])
    (port,) = [a for a in probe["exec"]["command"] if a.startswith("--port=")]
    return int(port.removeprefix("--port="))


def probe_service(probe: dict[str, Any]) -> str:
    if "grpc" in probe:
        return str(probe["grpc"].get("service", ""))
    services = [a for a in probe["exec"]["command"] if a.startswith("--service=")]
    return services[0].removeprefix("--service=") if services else ""


def seconds_to_fail(probe: dict[str, Any]) -> int:
    return int(probe["periodSeconds"]) * int(probe["failureThreshold"])


@pytest.mark.parametrize("base", BASES)
def test_kustomization_lists_every_manifest(base: str) -> None:
    listed = yaml.safe_load((DEPLOY / base / "kustomization.yaml").read_text())["resources"]
    manifests = [p.name for p in (DEPLOY / base).glob("*.yaml") if p.name != "kustomization.yaml"]
    assert sorted(listed) == sorted(manifests)


@pytest.mark.parametrize("overlay", ["", "no-tls"])
def test_service_ports_and_probes_match_the_service(overlay: str) -> None:
    defaults = service_defaults()
    deployment = find("Deployment", REPLICAS, overlay)
    variables = env(deployment)
    assert ports(deployment)["grpc"] == int(variables["GRPC_PORT"]) == defaults.port
    assert ports(deployment)["metrics"] == int(variables["METRICS_PORT"]) == defaults.metrics_port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert probe_port(container(deployment)[probe]) == ports(deployment)["grpc"], probe
        assert probe_service(container(deployment)[probe]) == "", probe  # the server's health
    assert container(deployment)["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels(deployment).items()


def test_kubernetes_waits_for_the_longest_drain() -> None:
    """The pod's termination grace covers the longest drain: the drain delay, requests in flight
    for up to the shutdown grace, then the engine's stop and the process's exit (measured by
    tests/test_multi_replica.py: the exit follows `stopped` within a second)."""
    deployment = find("Deployment", REPLICAS)
    variables = env(deployment)
    longest_drain = (
        float(variables["DRAIN_DELAY_SECONDS"])
        + float(variables["SHUTDOWN_GRACE_SECONDS"])
        + ServerSettings.engine_stop_seconds
        + EXIT_SECONDS
    )
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert longest_drain <= grace, "Kubernetes would kill the pod before its requests finish"


def test_replicas_keep_serving_until_envoy_has_taken_them_out() -> None:
    template = yaml.safe_load(ENVOY_TEMPLATE.read_text())
    (check,) = template["static_resources"]["clusters"][0]["health_checks"]
    seconds = {key: float(check[key].removesuffix("s")) for key in ("interval", "timeout")}
    # The slowest notice of NOT_SERVING: a check answered just before, then the next one's
    # answer (a NOT_SERVING answer takes the replica out at once, whatever unhealthy_threshold,
    # which counts checks that got no answer).
    slowest_notice = seconds["interval"] + seconds["timeout"]
    assert float(env(find("Deployment", REPLICAS))["DRAIN_DELAY_SECONDS"]) > slowest_notice


def test_loads_and_pool_discovery_get_their_time() -> None:
    """A replica may load for as long as Envoy's launcher waits for a pool to answer (with
    several pools, deploy/two-models), and the launcher may wait that long before Envoy
    listens: the kubelet restarts neither meanwhile."""
    replica_startup = seconds_to_fail(container(find("Deployment", REPLICAS))["startupProbe"])
    envoy_startup = seconds_to_fail(container(find("Deployment", ENVOY))["startupProbe"])
    assert 20 * 60 <= replica_startup <= DEFAULT_DISCOVERY_TIMEOUT < envoy_startup


def test_headless_service_selects_the_replicas() -> None:
    headless = find("Service", "llm-completions-headless")
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"].items() <= labels(find("Deployment", REPLICAS)).items()
    service_ports = {port["name"]: port for port in headless["spec"]["ports"]}
    assert service_ports["grpc"]["port"] == service_defaults().port
    assert service_ports["grpc"]["targetPort"] == "grpc"


def cluster_name(service: str, namespace: str) -> str:
    return f"{service}.{namespace}.svc.cluster.local"


@pytest.mark.parametrize("overlay", ["", "no-tls"])
def test_envoy_points_at_the_headless_service_and_listens_where_envoy_yaml_says(
    overlay: str,
) -> None:
    deployment = find("Deployment", ENVOY, overlay)
    assert container(deployment)["command"] == ["python", "-m", "facade.launch"]
    headless = find("Service", "llm-completions-headless", overlay)
    frontends = parse_replica(flag(deployment, "upstream"))
    hosts = {host for host, _ in frontends}
    assert hosts == {cluster_name("llm-completions-headless", headless["metadata"]["namespace"])}
    assert tuple(port for _, port in frontends) == frontend_ports(overlay)
    template = yaml.safe_load(ENVOY_TEMPLATE.read_text())
    listener_port = template["static_resources"]["listeners"][0]["address"]["socket_address"]
    http_port = int(flag(deployment, "http-port"))
    assert http_port == listener_port["port_value"] == ports(deployment)["http"]
    # Envoy's admin is not a port of the pod: it listens on the pod's loopback.
    assert int(flag(deployment, "admin-port")) not in ports(deployment).values()
    front = find("Service", "llm-completions", overlay)
    assert front["spec"]["selector"].items() <= labels(deployment).items()
    assert front["spec"]["ports"][0]["targetPort"] == "http"


@pytest.mark.parametrize("upstream", ["llm-completions-headless.default.svc.cluster.local:50051"])
def test_a_hostname_upstream_is_resolved_with_dns(upstream: str) -> None:
    from facade.render import render_config

    config = render_config(8080, 9901, [parse_address(upstream)], listen_host="0.0.0.0")
    cluster = config["static_resources"]["clusters"][0]
    assert cluster["type"] == "STRICT_DNS"
    assert config["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"


def served_pools() -> dict[str, tuple[tuple[str, int], ...]]:
    """deploy/two-models' replicas: served model name -> the frontends of the headless Service
    selecting them."""
    pools = {}
    services = of_kind("Service", "two-models")
    for deployment in replica_deployments("two-models"):
        (headless,) = [
            s for s in services if s["spec"]["selector"].items() <= labels(deployment).items()
        ]
        address = cluster_name(headless["metadata"]["name"], headless["metadata"]["namespace"])
        pools[env(deployment)["SERVED_MODEL_NAME"]] = tuple(
            (address, port) for port in frontend_ports("two-models")
        )
    return pools


def test_two_models_are_two_pools_behind_one_envoy() -> None:
    """deploy/two-models: each pool serves its own model under its own name, and Envoy and the
    picker it asks have one --pool per served name, at the headless Service of that pool's
    replicas on the service's port."""
    pools = served_pools()
    assert len(pools) == 2
    assert len({env(d)["MODEL"] for d in replica_deployments("two-models")}) == 2
    assert {ports for ports in pools.values() if len(ports) < 2} == set(), "one frontend each"
    for name in (ENVOY, PICKER):
        deployment = find("Deployment", name, "two-models")
        assert "upstream" not in flags(deployment), name  # one pool, or several
        given = [text.split("=", 1) for text in flags(deployment)["pool"]]
        assert {model: parse_replica(address) for model, address in given} == pools, name
    # The rest of Envoy's command line is deploy/'s.
    one, two = (flags(find("Deployment", ENVOY, o)) for o in ("", "two-models"))
    assert {k: v for k, v in one.items() if k != "upstream"} == {
        k: v for k, v in two.items() if k != "pool"
    }


def test_both_envoys_ask_one_picker_that_checks_the_same_replicas() -> None:
    picker = find("Deployment", PICKER)
    envoy = find("Deployment", ENVOY)
    assert picker["spec"]["replicas"] == 1
    assert picker["spec"]["strategy"]["type"] == "Recreate"  # never two dealing prefixes
    assert container(picker)["command"] == ["python", "-m", "facade.picker.server"]
    assert flags(picker)["upstream"] == flags(envoy)["upstream"]
    listen_host, listen_port = parse_address(flag(picker, "listen"))
    assert listen_host == "0.0.0.0"
    assert ports(picker)["picker"] == listen_port
    service = find("Service", PICKER)
    assert service["spec"]["selector"].items() <= labels(picker).items()
    (port,) = service["spec"]["ports"]
    host, asked_port = parse_address(flag(envoy, "picker"))
    assert host == cluster_name(PICKER, service["metadata"]["namespace"])
    assert asked_port == port["port"] == listen_port
    assert port["targetPort"] == "picker"


@pytest.mark.parametrize("overlay", ["", "no-tls"])
def test_the_picker_is_probed_on_the_health_services_it_serves(overlay: str) -> None:
    """The endpoint picker protocol's: alive while it answers, ready once it has a view of
    the replicas."""
    picker = find("Deployment", PICKER, overlay)
    listen_port = parse_address(flag(picker, "listen"))[1]
    live, ready = (container(picker)[p] for p in ("livenessProbe", "readinessProbe"))
    assert probe_port(live) == probe_port(ready) == listen_port
    assert probe_service(live) == "liveness"
    assert probe_service(ready) in facade.picker.server.READY


class RecordingEnviron(dict[str, str]):
    """os.environ's stand-in: the variables a parser reads, and the values it finds."""

    def __init__(self, values: dict[str, str]) -> None:
        super().__init__(values)
        self.read: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)


# Each program's parser, and the variables it reads at run time beyond its options: Envoy's
# launcher asks the pools with API_KEY (docs/scaling-out/pools.md).
PROGRAMS: dict[str, tuple[Callable[[], argparse.ArgumentParser], set[str]]] = {
    "llm-completions": (build_parser, set()),
    "facade.launch": (lambda: facade.options.build_parser("facade.launch"), {"API_KEY"}),
    "facade.picker.server": (facade.picker.server.build_parser, set()),
}


def program(deployment: Document) -> str:
    command = container(deployment).get("command")
    return "llm-completions" if command is None else command[-1]


def parse_as_the_pod(
    deployment: Document, monkeypatch: pytest.MonkeyPatch
) -> tuple[argparse.Namespace, set[str]]:
    """The container's command line parsed by its program's parser, in its environment: the
    options it gets, and every variable the parser or the program reads."""
    make_parser, runtime = PROGRAMS[program(deployment)]
    environ = RecordingEnviron({k: v for k, v in env(deployment).items() if v != "<secret>"})
    monkeypatch.setattr(os, "environ", environ)
    options = make_parser().parse_args(arguments(deployment))
    return options, environ.read | runtime


def all_deployments() -> Iterator[Document]:
    """Every Deployment of ours (deploy/tenants adds Redis's, whose options are its own)."""
    for overlay in ("", "no-tls", "cpu", "two-models", "tenants"):
        for deployment in of_kind("Deployment", overlay):
            if container(deployment)["image"].startswith("llm-completions"):
                yield deployment


def test_every_variable_and_argument_is_an_option_of_its_program(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each container's arguments parse with its program's own parser, and each variable set
    is one that program reads (a misspelt one would be ignored in silence)."""
    for deployment in all_deployments():
        _, read = parse_as_the_pod(deployment, monkeypatch)
        unread = set(env(deployment)) - read - NOT_OPTIONS
        assert not unread, f"{deployment['metadata']['name']} sets {unread}, which nothing reads"


def path(value: str | None) -> Path | None:
    return None if value is None else Path(value)


@pytest.mark.parametrize("overlay", TLS_OVERLAYS)
def test_tls_reaches_every_option_that_turns_it_on(
    overlay: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With TLS, the replicas and Envoy's listener serve it, Envoy verifies the replicas and
    the picker, and the picker serves it and verifies the replicas it checks; every file from
    the pod's Secrets. Without (deploy/no-tls), none of them is set."""
    expected = {
        "llm-completions": ("tls_cert_file", "tls_key_file"),
        "facade.launch": ("tls_cert_file", "tls_key_file", "upstream_ca_file", "picker_ca_file"),
        "facade.picker.server": ("tls_cert_file", "tls_key_file", "upstream_ca_file"),
    }
    for deployment in of_kind("Deployment", overlay):
        options, _ = parse_as_the_pod(deployment, monkeypatch)
        for option in expected[program(deployment)]:
            assert getattr(options, option) is not None, (deployment["metadata"]["name"], option)
    for deployment in of_kind("Deployment", "no-tls"):
        options, _ = parse_as_the_pod(deployment, monkeypatch)
        for option in expected[program(deployment)]:
            assert getattr(options, option) is None, (deployment["metadata"]["name"], option)


def dns_names(secret: str) -> set[str]:
    (certificate,) = [
        c for c in of_kind("Certificate", "cert-manager") if c["spec"]["secretName"] == secret
    ]
    return set(certificate["spec"]["dnsNames"])


def secret_of(deployment: Document, file_variable: str) -> str:
    """The Secret mounted where the container's `file_variable` points."""
    directory = env(deployment)[file_variable].rpartition("/")[0]
    spec = deployment["spec"]["template"]["spec"]
    (mount,) = [m for m in container(deployment)["volumeMounts"] if m["mountPath"] == directory]
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    return str(volume["secret"]["secretName"])


def test_certificates_name_the_hosts_their_clients_dial() -> None:
    """A server's certificate must name the host its clients dial, exactly as given (gRPC's
    check, and Envoy's per cluster: facade/tls.py), and localhost for the pod's own probes."""
    overlay = "cert-manager"
    envoy, picker = (find("Deployment", name, overlay) for name in (ENVOY, PICKER))
    (replicas,) = replica_deployments(overlay)
    replica_secret = secret_of(replicas, "TLS_CERT_FILE")
    assert secret_of(envoy, "UPSTREAM_CA_FILE") == secret_of(picker, "UPSTREAM_CA_FILE")
    assert secret_of(envoy, "UPSTREAM_CA_FILE") == replica_secret
    dialled = {parse_replica(flag(d, "upstream"))[0][0] for d in (envoy, picker)}
    assert dialled | {"localhost"} <= dns_names(replica_secret)
    picker_secret = secret_of(picker, "PICKER_TLS_CERT_FILE")
    assert secret_of(envoy, "PICKER_CA_FILE") == picker_secret
    assert {parse_address(flag(envoy, "picker"))[0], "localhost"} <= dns_names(picker_secret)
    front = find("Service", "llm-completions", overlay)
    front_name = cluster_name("llm-completions", front["metadata"]["namespace"])
    assert front_name in dns_names(secret_of(envoy, "TLS_CERT_FILE"))


def test_prometheus_scrapes_the_port_the_service_serves_metrics_on() -> None:
    """The ServiceMonitor's port is the headless Service's `metrics`, which is the container's
    METRICS_PORT; the scrape annotations name the same port."""
    overlay = "monitoring"
    (monitor,) = of_kind("ServiceMonitor", overlay)
    (replicas,) = replica_deployments(overlay)
    headless = find("Service", "llm-completions-headless", overlay)
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= headless["metadata"]["labels"].items()
    )
    (endpoint,) = monitor["spec"]["endpoints"]
    (port,) = [p for p in headless["spec"]["ports"] if p["name"] == endpoint["port"]]
    metrics_port = int(env(replicas)["METRICS_PORT"])
    assert ports(replicas)[port["targetPort"]] == metrics_port
    annotations = replicas["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == metrics_port
    assert annotations["prometheus.io/path"] == endpoint["path"] == "/metrics"


def vllm_metric_names() -> str:
    """vLLM's metrics module, read without importing vLLM."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations
    package = Path(next(iter(spec.submodule_search_locations)))
    return (package / "v1" / "metrics" / "loggers.py").read_text()


def test_autoscaling_queries_metrics_the_replicas_export() -> None:
    """KEDA scales the replica Deployment (which leaves it the count) on series the service
    exports, selected by the namespace and the headless Service that Prometheus labels them
    with."""
    from service.model.capacity import Capacity
    from service.transport.observability import CAPACITY

    overlay = "autoscaling"
    (scaled,) = of_kind("ScaledObject", overlay)
    (replicas,) = replica_deployments(overlay)
    assert scaled["spec"]["scaleTargetRef"]["name"] == replicas["metadata"]["name"]
    assert "replicas" not in replicas["spec"]
    headless = find("Service", "llm-completions-headless", overlay)
    exported = vllm_metric_names()
    for trigger in scaled["spec"]["triggers"]:
        query = trigger["metadata"]["query"]
        for name, selector in re.findall(r"([\w:]+)\{([^}]*)\}", query):
            assert name == CAPACITY._name or f'name="{name}"' in exported, name
            pairs = dict(re.findall(r'(\w+)="([^"]*)"', selector))
            assert pairs["namespace"] == headless["metadata"]["namespace"], query
            assert pairs["service"] == headless["metadata"]["name"], query
            if name == CAPACITY._name:
                assert pairs["limit"] in Capacity.__dataclass_fields__, query
        assert 0 < float(trigger["metadata"]["threshold"]) < 1, "a share of the capacity"
