"""deploy/ agrees with the code: names, ports and probes match envoy.yaml and the service's
defaults, and Envoy's upstream is the headless Service."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from facade.addresses import parse_address
from facade.render import ENVOY_TEMPLATE
from service.cli import build_parser
from service.settings import ServerSettings

# From `stopped` to the end of the process, with room to spare (measured: under 0.1 s).
EXIT_SECONDS = 1.0

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


TWO_MODELS = DEPLOY / "two-models"


def manifests(directory: Path) -> list[Path]:
    return sorted(p for p in directory.glob("*.yaml") if p.name != "kustomization.yaml")


def kustomization(directory: Path) -> dict[str, Any]:
    return yaml.safe_load((directory / "kustomization.yaml").read_text())


def documents() -> list[dict[str, Any]]:
    """The manifests of deploy/ (one model), from its bases."""
    return [
        document
        for base in kustomization(DEPLOY)["resources"]
        for path in manifests(DEPLOY / base)
        for document in yaml.safe_load_all(path.read_text())
    ]


def find(kind: str, name: str) -> dict[str, Any]:
    matches = [d for d in documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}"
    return matches[0]


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def env(container_spec: dict[str, Any]) -> dict[str, str]:
    return {item["name"]: item.get("value", "") for item in container_spec.get("env", [])}


def service_defaults() -> Any:
    return build_parser().parse_args(["serve"])


@pytest.mark.parametrize("base", ["model", "envoy"])
def test_kustomization_lists_every_manifest(base: str) -> None:
    assert base in kustomization(DEPLOY)["resources"]
    listed = kustomization(DEPLOY / base)["resources"]
    assert sorted(listed) == [p.name for p in manifests(DEPLOY / base)]


def test_service_ports_and_probes_match_the_service() -> None:
    defaults = service_defaults()
    deployment = find("Deployment", "llm-completions")
    spec = container(deployment)
    ports = {port["name"]: port["containerPort"] for port in spec["ports"]}
    variables = env(spec)
    assert ports["grpc"] == int(variables["GRPC_PORT"]) == defaults.port
    assert ports["metrics"] == int(variables["METRICS_PORT"]) == defaults.metrics_port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert spec[probe]["grpc"]["port"] == ports["grpc"], probe
    assert spec["resources"]["requests"]["nvidia.com/gpu"] == 1
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_kubernetes_waits_for_the_longest_drain() -> None:
    """The pod's termination grace covers the longest drain: the drain delay, requests in flight
    for up to the shutdown grace, then the engine's stop and the process's exit (measured by
    tests/test_multi_replica.py: the exit follows `stopped` within a second)."""
    spec = find("Deployment", "llm-completions")["spec"]["template"]["spec"]
    variables = env(container(find("Deployment", "llm-completions")))
    longest_drain = (
        float(variables["DRAIN_DELAY_SECONDS"])
        + float(variables["SHUTDOWN_GRACE_SECONDS"])
        + ServerSettings.engine_stop_seconds
        + EXIT_SECONDS
    )
    assert longest_drain <= spec["terminationGracePeriodSeconds"], (
        "Kubernetes would kill the pod before its requests finish"
    )


def test_replicas_keep_serving_until_envoy_has_taken_them_out() -> None:
    template = yaml.safe_load(ENVOY_TEMPLATE.read_text())
    (check,) = template["static_resources"]["clusters"][0]["health_checks"]
    seconds = {key: float(check[key].removesuffix("s")) for key in ("interval", "timeout")}
    # The slowest notice of NOT_SERVING: a check answered just before, then the next one's
    # answer (a NOT_SERVING answer takes the replica out at once, whatever unhealthy_threshold,
    # which counts checks that got no answer).
    slowest_notice = seconds["interval"] + seconds["timeout"]
    drain_delay = float(
        env(container(find("Deployment", "llm-completions")))["DRAIN_DELAY_SECONDS"]
    )
    assert drain_delay > slowest_notice


def test_headless_service_selects_the_replicas() -> None:
    headless = find("Service", "llm-completions-headless")
    assert headless["spec"]["clusterIP"] == "None"
    labels = find("Deployment", "llm-completions")["spec"]["template"]["metadata"]["labels"]
    assert headless["spec"]["selector"].items() <= labels.items()
    (port,) = headless["spec"]["ports"]
    assert port["port"] == service_defaults().port


def test_envoy_points_at_the_headless_service_and_listens_where_envoy_yaml_says() -> None:
    deployment = find("Deployment", "llm-completions-envoy")
    spec = container(deployment)
    assert spec["command"] == ["python", "-m", "facade.launch"]
    envoy_flags = flags("llm-completions-envoy")
    host, port = parse_address(envoy_flags["upstream"])
    assert host.split(".")[0] == "llm-completions-headless"
    assert port == find("Service", "llm-completions-headless")["spec"]["ports"][0]["port"]
    template = yaml.safe_load(ENVOY_TEMPLATE.read_text())
    listener_port = template["static_resources"]["listeners"][0]["address"]["socket_address"]
    assert int(envoy_flags["http-port"]) == listener_port["port_value"]
    http_port = int(envoy_flags["http-port"])
    assert {p["name"]: p["containerPort"] for p in spec["ports"]}["http"] == http_port
    front = find("Service", "llm-completions")
    assert (
        front["spec"]["selector"].items()
        <= deployment["spec"]["template"]["metadata"]["labels"].items()
    )
    assert front["spec"]["ports"][0]["targetPort"] == "http"


@pytest.mark.parametrize("upstream", ["llm-completions-headless.default.svc.cluster.local:50051"])
def test_a_hostname_upstream_is_resolved_with_dns(upstream: str) -> None:
    from facade.render import render_config

    config = render_config(8080, 9901, [parse_address(upstream)], listen_host="0.0.0.0")
    cluster = config["static_resources"]["clusters"][0]
    assert cluster["type"] == "STRICT_DNS"
    assert config["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"


def patched(directory: Path, kind: str, name: str | None = None) -> list[dict[str, Any]]:
    """The JSON patch operations a kustomization applies to its `kind` (named `name`)."""
    (patch,) = [
        p
        for p in kustomization(directory)["patches"]
        if p["target"]["kind"] == kind and name in (None, p["target"].get("name"))
    ]
    return yaml.safe_load(patch["patch"])


def env_index(name: str) -> int:
    names = [item["name"] for item in container(find("Deployment", "llm-completions"))["env"]]
    return names.index(name)


def test_two_models_are_two_pools_behind_one_envoy() -> None:
    """deploy/two-models: each model's overlay sets its own model and served name (at the
    indices the base has them), and Envoy's pools are those served names, each at its own
    model's headless Service on the service's port."""
    overlays = [r for r in kustomization(TWO_MODELS)["resources"] if not r.startswith("..")]
    served = {}
    for overlay in overlays:
        settings = kustomization(TWO_MODELS / overlay)
        assert settings["resources"] == ["../../model"]
        assert settings["labels"][0]["includeSelectors"]  # each headless Service its own pods
        values = {op["path"]: op["value"] for op in patched(TWO_MODELS / overlay, "Deployment")}
        env_path = "/spec/template/spec/containers/0/env/{}"
        assert values[env_path.format(env_index("MODEL"))]["name"] == "MODEL"
        name = values[env_path.format(env_index("SERVED_MODEL_NAME"))]
        assert name["name"] == "SERVED_MODEL_NAME"
        served[name["value"]] = f"llm-completions-headless{settings['nameSuffix']}"
    grpc_port = service_defaults().port
    # Envoy and the picker it asks, alike.
    for deployment in ("llm-completions-envoy", "llm-completions-picker"):
        args = container(find("Deployment", deployment))["args"]
        operations = patched(TWO_MODELS, "Deployment", deployment)
        replaced = operations[0]["path"].rsplit("/", 1)[1]
        assert args[int(replaced)].startswith("--upstream="), deployment  # one pool: several
        pools = [op["value"].removeprefix("--pool=") for op in operations if "args" in op["path"]]
        assert {n: parse_address(address) for n, address in (p.split("=") for p in pools)} == {
            name: (f"{service}.default.svc.cluster.local", grpc_port)
            for name, service in served.items()
        }, deployment


def flags(deployment: str) -> dict[str, str]:
    spec = container(find("Deployment", deployment))
    return dict(arg.removeprefix("--").split("=", 1) for arg in spec["args"])


def test_both_envoys_ask_one_picker_that_checks_the_same_replicas() -> None:
    picker = find("Deployment", "llm-completions-picker")
    assert picker["spec"]["replicas"] == 1
    assert picker["spec"]["strategy"]["type"] == "Recreate"  # never two dealing prefixes
    spec = container(picker)
    assert spec["command"] == ["python", "-m", "facade.picker.server"]
    assert flags("llm-completions-picker")["upstream"] == flags("llm-completions-envoy")["upstream"]
    listen_host, listen_port = parse_address(flags("llm-completions-picker")["listen"])
    assert listen_host == "0.0.0.0"
    assert {p["name"]: p["containerPort"] for p in spec["ports"]}["picker"] == listen_port
    # Probed on the endpoint picker protocol's health services, which the picker serves.
    assert spec["livenessProbe"]["grpc"] == {"port": listen_port, "service": "liveness"}
    assert spec["readinessProbe"]["grpc"] == {"port": listen_port, "service": "readiness"}
    service = find("Service", "llm-completions-picker")
    labels = picker["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    (port,) = service["spec"]["ports"]
    host, asked_port = parse_address(flags("llm-completions-envoy")["picker"])
    assert host.split(".")[0] == "llm-completions-picker"
    assert asked_port == port["port"]
    assert port["targetPort"] == "picker"
