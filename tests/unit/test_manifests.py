"""deploy/ as an operator applies it: every overlay renders with kustomize, every document
validates offline against the Kubernetes API's schemas (custom resources, which those schemas
lack, against the fields their CRDs require), passes checkov's Kubernetes checks, and every pod
runs locked down, with a disruption budget, network policies that let the fleet talk, and
probes that work over TLS.

Rendering needs `kubectl kustomize` (or `kustomize build`); checkov runs from its own venv,
which `make unit` installs (.venv/tools/checkov: its pins conflict with the project's).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import jsonschema
import kubernetes_validate
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from plumbing.tracing import ENDPOINT_ENV, PROTOCOL_ENV
from tests.certificates import CertificateAuthority

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
# What an operator applies: deploy/ itself ("") and each overlay beside its base.
OVERLAYS = (
    "",
    "no-tls",
    "cert-manager",
    "cpu",
    "monitoring",
    "autoscaling",
    "tracing",
    "two-models",
    "inference-gateway",
    "tenants",
)
# Directories that are parts of the overlays, not applied alone.
PARTS = {"base", "model", "envoy", "policies", "components"}
# The oldest Kubernetes these manifests are for, and the newest kubernetes-validate knows:
# fields added after the first, or removed before the second, fail strict validation.
KUBERNETES_VERSIONS = ("1.29", "1.37")
# Custom resources, which the Kubernetes schemas lack: the fields their CRDs require (and
# that the controllers need to act), each a path of keys. From the CRDs of cert-manager v1,
# the Prometheus Operator's monitoring.coreos.com/v1 and KEDA's keda.sh/v1alpha1.
CUSTOM_RESOURCES: dict[tuple[str, str], tuple[tuple[str, ...], ...]] = {
    ("cert-manager.io/v1", "Certificate"): (("spec", "secretName"), ("spec", "issuerRef", "name")),
    ("cert-manager.io/v1", "Issuer"): (("spec",),),
    ("monitoring.coreos.com/v1", "ServiceMonitor"): (("spec", "selector"), ("spec", "endpoints")),
    ("keda.sh/v1alpha1", "ScaledObject"): (
        ("spec", "scaleTargetRef", "name"),
        ("spec", "triggers"),
    ),
    ("gateway.networking.k8s.io/v1", "Gateway"): (
        ("spec", "gatewayClassName"),
        ("spec", "listeners"),
    ),
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): (("spec", "parentRefs"), ("spec", "rules")),
    # Also validated against its whole CRD: test_the_inference_pool_is_its_crds_and_the_fleets.
    ("inference.networking.k8s.io/v1", "InferencePool"): (
        ("spec", "selector"),
        ("spec", "targetPorts"),
    ),
}
# The InferencePool CRD of the Gateway API Inference Extension v1.6.0, as released
# (config/crd/bases of kubernetes-sigs/gateway-api-inference-extension, Apache-2.0).
INFERENCE_POOL_CRD = (
    Path(__file__).parent / "crds" / "inference.networking.k8s.io_inferencepools.yaml"
)
ISSUER_KINDS = {"ca", "selfSigned", "acme", "vault", "venafi"}  # an Issuer has exactly one

CHECKOV = ROOT / ".venv" / "tools" / "checkov" / "bin" / "checkov"
# checkov's Kubernetes checks these manifests fail on purpose, each with its reason.
CHECKOV_SKIPS = {
    # CPU limits: only the CPU replicas have them (requests equal to limits, for cores of their
    # own). A CFS quota on the GPU replicas, Envoy or the picker throttles them under load and
    # adds latency to every call; their requests reserve what they need.
    "CKV_K8S_11": "CPU limits would throttle the GPU replicas, Envoy and the picker",
    # Secrets as files: the service reads its API key only from API_KEY (--api-key), and Envoy's
    # launcher the replicas' key likewise (deploy/two-models); TLS keys are files.
    "CKV_K8S_35": "the API key is read only from the environment (API_KEY)",
    # A UID above 10000: the image runs as UID 2000 (its files are 2000's and group 0's), which
    # runAsUser states; runAsNonRoot holds either way.
    "CKV_K8S_40": "the image's user is UID 2000",
    # Images by digest: the base names a tag (`make image`'s); an operator pins the digest of
    # what they pushed with `images:` (docs/deploying/image.md).
    "CKV_K8S_43": "the digest is the operator's to pin, with kustomize images:",
}
# checkov and its libraries stay offline: no guidelines from Prisma Cloud, no version check.
CHECKOV_OFFLINE = {"BC_SKIP_MAPPING": "TRUE", "CKV_SKIP_PACKAGE_UPDATE_CHECK": "true"}

PROBE = DEPLOY / "components" / "tls" / "health_probe.py"
PROBE_MOUNT = "/etc/llm-completions/probe"

Document = dict[str, Any]


def kustomize_command() -> list[str] | None:
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    return None


def render(directory: Path) -> list[Document]:
    command = kustomize_command()
    if command is None:
        pytest.skip("rendering deploy/ needs kubectl (kubectl kustomize) or kustomize")
    output = subprocess.run([*command, str(directory)], capture_output=True, text=True, check=False)
    assert output.returncode == 0, f"{directory} does not render: {output.stderr}"
    return [document for document in yaml.safe_load_all(output.stdout) if document]


def render_all(directories: list[Path]) -> list[list[Document]]:
    """Several at once (kustomize is a process each)."""
    with futures.ThreadPoolExecutor(max_workers=len(directories)) as pool:
        return list(pool.map(render, directories))


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Document]]:
    documents = render_all([DEPLOY / overlay for overlay in OVERLAYS])
    return dict(zip(OVERLAYS, documents, strict=True))


def unique(rendered: dict[str, list[Document]]) -> list[Document]:
    """Every document once (the overlays share most of theirs)."""
    seen: dict[str, Document] = {}
    for documents in rendered.values():
        for document in documents:
            seen.setdefault(json.dumps(document, sort_keys=True), document)
    return list(seen.values())


def of_kind(documents: list[Document], kind: str) -> list[Document]:
    return [document for document in documents if document["kind"] == kind]


def named(documents: list[Document], kind: str, name: str) -> Document:
    (found,) = [d for d in of_kind(documents, kind) if d["metadata"]["name"] == name]
    return found


def pod_spec(deployment: Document) -> dict[str, Any]:
    return deployment["spec"]["template"]["spec"]


def pod_labels(deployment: Document) -> dict[str, str]:
    return deployment["spec"]["template"]["metadata"]["labels"]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def deployments(rendered: dict[str, list[Document]]) -> Iterator[tuple[str, Document]]:
    for overlay, documents in rendered.items():
        for deployment in of_kind(documents, "Deployment"):
            yield f"{overlay or 'deploy'}: {deployment['metadata']['name']}", deployment


def replica_deployments(documents: list[Document]) -> list[Document]:
    return [
        d for d in of_kind(documents, "Deployment") if pod_labels(d)["app"] == "llm-completions"
    ]


def test_every_overlay_renders_and_is_tested(rendered: dict[str, list[Document]]) -> None:
    applied = {
        path.parent.name
        for path in DEPLOY.glob("*/kustomization.yaml")
        if path.parent.name not in PARTS
    }
    assert applied == set(OVERLAYS) - {""}, "an overlay this test does not render"
    for overlay, documents in rendered.items():
        assert of_kind(documents, "Deployment"), overlay
    # deploy/ is its base.
    assert yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())["resources"] == ["base"]


def test_built_in_kinds_validate_against_the_kubernetes_schemas(
    rendered: dict[str, list[Document]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Strictly (an unknown or misspelt field fails), for the oldest and newest versions;
    custom resources are left to the next test."""
    # kubernetes-validate reads its schema files (1.8 MB of definitions) at every call: once.
    read = kubernetes_validate.utils.schema_contents
    monkeypatch.setattr(kubernetes_validate.utils, "schema_contents", functools.cache(read))
    custom = []
    for document in unique(rendered):
        for version in KUBERNETES_VERSIONS:
            try:
                kubernetes_validate.validate(document, version, strict=True)
            except kubernetes_validate.SchemaNotFoundError:
                custom.append((document["apiVersion"], document["kind"]))
            except kubernetes_validate.ValidationError as error:
                path = ".".join(str(part) for part in error.path)
                name = f"{document['kind']}/{document['metadata']['name']}"
                pytest.fail(f"{name} against Kubernetes {version}: {path}: {error.message}")
    assert set(custom) <= set(CUSTOM_RESOURCES), "a custom resource nothing here checks"


def test_custom_resources_carry_what_their_crds_require(
    rendered: dict[str, list[Document]],
) -> None:
    found = set()
    for document in unique(rendered):
        key = (document["apiVersion"], document["kind"])
        if key not in CUSTOM_RESOURCES:
            continue
        found.add(key)
        assert document["metadata"]["name"] and document["metadata"]["namespace"], key
        for path in CUSTOM_RESOURCES[key]:
            value: Any = document
            for part in path:
                value = value.get(part) if isinstance(value, dict) else None
            assert value not in (None, "", [], {}), f"{key}: {'.'.join(path)} is missing"
        if document["kind"] == "Issuer":
            assert len(ISSUER_KINDS & document["spec"].keys()) == 1, document["metadata"]
    assert found == set(CUSTOM_RESOURCES), "a custom resource no overlay renders"


@pytest.fixture(scope="module", autouse=True)
def checkov(
    rendered: dict[str, list[Document]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[subprocess.Popen[str] | None]:
    """checkov's Kubernetes checks over every overlay at once (it takes seconds to start),
    started before this module's first test and read by test_checkov_finds_nothing: it runs
    while the others do."""
    if not CHECKOV.exists():
        yield None
        return
    directory = tmp_path_factory.mktemp("rendered")
    for overlay, documents in rendered.items():
        (directory / f"{overlay or 'deploy'}.yaml").write_text(yaml.safe_dump_all(documents))
    command = [
        *(str(CHECKOV), "--directory", str(directory), "--framework", "kubernetes"),
        *("--skip-check", ",".join(CHECKOV_SKIPS), "--skip-download"),
        *("--output", "json", "--compact", "--quiet"),
    ]
    env = {**os.environ, **CHECKOV_OFFLINE}
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    ) as process:
        yield process
        process.kill()  # only if the test that reads it did not run


def test_every_pod_runs_locked_down(rendered: dict[str, list[Document]]) -> None:
    for name, deployment in deployments(rendered):
        spec = pod_spec(deployment)
        assert spec["automountServiceAccountToken"] is False, name
        assert spec["securityContext"] == {
            "runAsNonRoot": True,
            "runAsUser": 2000,
            "runAsGroup": 0,
            "fsGroup": 0,
            "seccompProfile": {"type": "RuntimeDefault"},
        }, name
        for container in spec["containers"]:
            assert container["securityContext"] == {
                "runAsNonRoot": True,
                "runAsUser": 2000,
                "runAsGroup": 0,
                "allowPrivilegeEscalation": False,
                "readOnlyRootFilesystem": True,
                "capabilities": {"drop": ["ALL"]},
                "seccompProfile": {"type": "RuntimeDefault"},
            }, name
    for overlay, documents in rendered.items():
        for namespace in of_kind(documents, "Namespace"):
            labels = namespace["metadata"]["labels"]
            assert labels["pod-security.kubernetes.io/enforce"] == "restricted", overlay


def mounts(deployment: Document) -> dict[str, dict[str, Any]]:
    """The container's mount paths and the volume behind each."""
    spec = pod_spec(deployment)
    volumes = {volume["name"]: volume for volume in spec["volumes"]}
    (container,) = spec["containers"]
    return {mount["mountPath"]: volumes[mount["name"]] for mount in container["volumeMounts"]}


def test_processes_write_only_to_volumes_of_their_own(rendered: dict[str, list[Document]]) -> None:
    """The root filesystem is read-only: /tmp is an emptyDir everywhere; the replicas also
    write their caches to /cache (where the image points HF_HOME, VLLM_CACHE_ROOT and the
    rest) and share tensors through a memory-backed /dev/shm. The model is read-only."""
    for name, deployment in deployments(rendered):
        volumes = mounts(deployment)
        assert "emptyDir" in volumes["/tmp"], name
        if pod_labels(deployment)["app"] == "llm-completions":
            assert "emptyDir" in volumes["/cache"], name
            assert volumes["/dev/shm"]["emptyDir"]["medium"] == "Memory", name
            assert volumes["/models"]["persistentVolumeClaim"]["readOnly"], name
        writable = {path for path, volume in volumes.items() if "emptyDir" in volume}
        assert writable <= {"/tmp", "/cache", "/dev/shm"}, name


def test_every_pool_has_a_disruption_budget(rendered: dict[str, list[Document]]) -> None:
    """One budget per Deployment, letting a drain take one pod at a time. The picker runs one
    copy (Recreate): maxUnavailable 1 lets a drain evict it (a budget of minAvailable 1 would
    block every drain)."""
    for overlay, documents in rendered.items():
        budgets = of_kind(documents, "PodDisruptionBudget")
        for deployment in of_kind(documents, "Deployment"):
            name = f"{overlay}: {deployment['metadata']['name']}"
            (budget,) = [
                b
                for b in budgets
                if selects(b["spec"]["selector"]["matchLabels"], pod_labels(deployment))
            ]
            assert budget["spec"] == budget["spec"] | {"maxUnavailable": 1}, name
            assert "minAvailable" not in budget["spec"], name
            if deployment["spec"].get("replicas", 2) == 1:
                assert deployment["spec"]["strategy"]["type"] == "Recreate", name


def container_ports(deployment: Document) -> dict[str, int]:
    (container,) = pod_spec(deployment)["containers"]
    return {port["name"]: port["containerPort"] for port in container["ports"]}


def allowed_from(policy: Document, port: str) -> list[dict[str, str] | None]:
    """The pod selectors an ingress rule admits on `port` (None: from anywhere)."""
    sources: list[dict[str, str] | None] = []
    for rule in policy["spec"]["ingress"]:
        if port in [p["port"] for p in rule["ports"]]:
            froms = rule.get("from")
            sources += [None] if not froms else [f["podSelector"]["matchLabels"] for f in froms]
    return sources


def reachable(documents: list[Document], target: Document, port: str, source: Document) -> bool:
    policies = [
        policy
        for policy in of_kind(documents, "NetworkPolicy")
        if selects(policy["spec"]["podSelector"]["matchLabels"], pod_labels(target))
    ]
    assert policies, f"no network policy selects {target['metadata']['name']}"
    assert port in container_ports(target)
    return any(
        selector is None or selects(selector, pod_labels(source))
        for policy in policies
        for selector in allowed_from(policy, port)
    )


def test_network_policies_let_the_fleet_talk_and_no_one_else(
    rendered: dict[str, list[Document]],
) -> None:
    for overlay in ("", "two-models"):
        documents = rendered[overlay]
        envoy = named(documents, "Deployment", "llm-completions-envoy")
        picker = named(documents, "Deployment", "llm-completions-picker")
        for replicas in replica_deployments(documents):
            for port in ("grpc", *FRONTEND_PORT_NAMES):
                assert reachable(documents, replicas, port, envoy)
                assert reachable(documents, replicas, port, picker)  # its health checks
            assert not reachable(documents, replicas, "grpc", replicas)
            assert reachable(documents, replicas, "metrics", replicas)  # Prometheus: anyone
        assert reachable(documents, picker, "picker", envoy)
        assert not reachable(documents, picker, "picker", picker)
        assert reachable(documents, envoy, "http", picker)  # callers: anyone


def quantity(text: str) -> float:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    for unit, factor in units.items():
        if text.endswith(unit):
            return float(text.removesuffix(unit)) * factor
    return float(text)


def env_names(container: dict[str, Any]) -> set[str]:
    return {item["name"] for item in container.get("env", [])}


def test_cpu_replicas_get_cores_of_their_own(rendered: dict[str, list[Document]]) -> None:
    """Guaranteed QoS with whole cores (the static CPU manager then gives the pod an exclusive
    cpuset), the CPU image, no GPU; CPU_CORES unset: it takes a list of core ids, which the
    downward API's count is not, and the engine binds to the pod's cpuset by itself."""
    (replicas,) = replica_deployments(rendered["cpu"])
    for container in pod_spec(replicas)["containers"]:
        resources = container["resources"]
        assert resources["requests"] == resources["limits"]
        assert float(resources["limits"]["cpu"]).is_integer()
        assert "nvidia.com/gpu" not in resources["limits"]
        assert "CPU_CORES" not in env_names(container)
        assert container["image"] == "llm-completions:cpu"
    assert "tolerations" not in pod_spec(replicas)
    (gpu_replicas,) = replica_deployments(rendered[""])
    (gpu,) = pod_spec(gpu_replicas)["containers"]
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert gpu["image"] == "llm-completions:gpu"
    # The memory-backed /dev/shm counts against the pod's memory: it must fit in it.
    shm = mounts(replicas)["/dev/shm"]["emptyDir"]["sizeLimit"]
    assert quantity(shm) < quantity(container["resources"]["limits"]["memory"])


def operator_kustomization(directory: Path, kustomization: dict[str, Any]) -> Path:
    """An operator's own kustomization in `directory`, its paths given relative to deploy/."""
    directory.mkdir()
    theirs = os.path.relpath(DEPLOY, directory)
    for field in ("resources", "components"):
        if field in kustomization:
            kustomization[field] = [f"{theirs}/{path}" for path in kustomization[field]]
    (directory / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return directory


def test_an_operator_retags_every_image_in_one_place(tmp_path: Path) -> None:
    """One `images:` entry in the operator's own kustomization renames every container's
    image (replicas, Envoy, picker), whatever it builds on: here deploy/base with the CPU and
    cert-manager components (docs/deploying/overview.md), and deploy/two-models. Each keeps its
    tag."""
    retag = [{"name": "llm-completions", "newName": "registry.example/llm-completions"}]
    composed = {
        "resources": ["base"],
        "components": ["components/cpu", "components/cert-manager"],
        "images": retag,
    }
    mine = [
        operator_kustomization(tmp_path / "composed", composed),
        operator_kustomization(tmp_path / "two", {"resources": ["two-models"], "images": retag}),
    ]
    composed_documents, two_models = render_all(mine)
    for documents, tag in ((composed_documents, "cpu"), (two_models, "gpu")):
        images = {
            container["image"]
            for deployment in of_kind(documents, "Deployment")
            for container in pod_spec(deployment)["containers"]
        }
        assert images == {f"registry.example/llm-completions:{tag}"}
    assert len(of_kind(composed_documents, "Certificate")) == 4  # the CA's and three
    (cpu_replicas,) = replica_deployments(composed_documents)
    assert "nvidia.com/gpu" not in pod_spec(cpu_replicas)["containers"][0]["resources"]["limits"]


def tracing_environment(documents: list[Document], deployment: Document) -> dict[str, str]:
    """What the tracing ConfigMap gives the deployment's process, through its envFrom."""
    (source,) = pod_spec(deployment)["containers"][0]["envFrom"]
    data: dict[str, str] = named(documents, "ConfigMap", source["configMapRef"]["name"])["data"]
    return data


def test_tracing_reaches_every_process_and_the_operator_sets_the_collector(
    rendered: dict[str, list[Document]], tmp_path: Path
) -> None:
    """deploy/tracing: the replicas, Envoy and the picker read the collector's address from
    the variable the programs read (plumbing.tracing), and an operator's own kustomization
    changes it in one place (docs/deploying/tracing.md)."""
    documents = rendered["tracing"]
    apps = set()
    for deployment in of_kind(documents, "Deployment"):
        environment = tracing_environment(documents, deployment)
        assert environment[ENDPOINT_ENV].startswith("http://"), environment
        assert environment[PROTOCOL_ENV] == "grpc"
        apps.add(pod_labels(deployment)["app"])
    assert apps == {"llm-completions", "llm-completions-envoy", "llm-completions-picker"}
    collector = "http://tempo.monitoring.svc:4317"
    mine = {
        "resources": ["tracing"],
        "configMapGenerator": [
            {
                "name": "llm-completions-tracing",
                "namespace": "llm-completions",
                "behavior": "merge",
                "literals": [f"{ENDPOINT_ENV}={collector}"],
            }
        ],
    }
    operators = render(operator_kustomization(tmp_path / "mine", mine))
    for deployment in of_kind(operators, "Deployment"):
        assert tracing_environment(operators, deployment)[ENDPOINT_ENV] == collector


def load_probe() -> ModuleType:
    spec = importlib.util.spec_from_file_location("health_probe", PROBE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def probe_arguments(container: dict[str, Any], probe: str) -> list[str]:
    """The probe's command line after the script's path, as the kubelet runs it."""
    command = container[probe]["exec"]["command"]
    assert command[:2] == ["python", f"{PROBE_MOUNT}/{PROBE.name}"], command
    return command[2:]


class HealthServer:
    """A gRPC health service over TLS on loopback, as a replica or the picker serves it."""

    def __init__(self, cert_file: Path, key_file: Path) -> None:
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        credentials = grpc.ssl_server_credentials([(key_file.read_bytes(), cert_file.read_bytes())])
        self.port = self.server.add_secure_port("127.0.0.1:0", credentials)
        self.server.start()

    def set(self, service: str, serving: bool) -> None:
        answer = health_pb2.HealthCheckResponse
        self.health.set(service, answer.SERVING if serving else answer.NOT_SERVING)


@pytest.fixture
def authority(tmp_path: Path) -> CertificateAuthority:
    return CertificateAuthority(tmp_path)


def run_probe(container: dict[str, Any], probe: str, port: int, ca_file: Path) -> int:
    """The manifest's probe against the server on `port`, its CA file a local copy."""
    arguments = [
        f"--port={port}" if a.startswith("--port=") else a
        for a in probe_arguments(container, probe)
    ]
    arguments = [f"--ca-file={ca_file}" if a.startswith("--ca-file=") else a for a in arguments]
    result: int = load_probe().main(arguments)
    return result


def test_the_replicas_probes_speak_tls(
    rendered: dict[str, list[Document]], authority: CertificateAuthority
) -> None:
    """Started and ready only while SERVING; alive while it answers at all (NOT_SERVING while
    loading or draining included)."""
    (replicas,) = replica_deployments(rendered[""])
    (container,) = pod_spec(replicas)["containers"]
    server_files = authority.server(by_ip=False, dns_name="localhost")
    server = HealthServer(server_files.cert_file, server_files.key_file)
    try:
        for serving, expected in ((True, 0), (False, 1)):
            server.set("", serving)
            assert run_probe(container, "startupProbe", server.port, authority.cert_file) == (
                expected
            )
            assert run_probe(container, "readinessProbe", server.port, authority.cert_file) == (
                expected
            )
            assert run_probe(container, "livenessProbe", server.port, authority.cert_file) == 0
    finally:
        server.server.stop(None)


def test_the_pickers_probes_ask_its_health_services(
    rendered: dict[str, list[Document]], authority: CertificateAuthority
) -> None:
    picker = named(rendered[""], "Deployment", "llm-completions-picker")
    (container,) = pod_spec(picker)["containers"]
    server_files = authority.server(by_ip=False, dns_name="localhost")
    server = HealthServer(server_files.cert_file, server_files.key_file)
    try:
        server.set("liveness", True)
        server.set("readiness", False)  # no view of the replicas yet
        assert run_probe(container, "livenessProbe", server.port, authority.cert_file) == 0
        assert run_probe(container, "readinessProbe", server.port, authority.cert_file) == 1
        server.set("readiness", True)
        assert run_probe(container, "readinessProbe", server.port, authority.cert_file) == 0
    finally:
        server.server.stop(None)


def test_a_certificate_that_does_not_name_localhost_fails_the_probe_with_a_reason(
    authority: CertificateAuthority, capsys: pytest.CaptureFixture[str]
) -> None:
    server_files = authority.server(dns_name="llm-completions-headless.example")
    server = HealthServer(server_files.cert_file, server_files.key_file)
    server.set("", True)
    try:
        arguments = [f"--port={server.port}", f"--ca-file={authority.cert_file}"]
        assert load_probe().main([*arguments, "--timeout=2"]) == 1
        assert f"health check of port {server.port} failed: UNAVAILABLE" in capsys.readouterr().err
    finally:
        server.server.stop(None)


def test_the_probe_runs_as_the_kubelet_runs_it(authority: CertificateAuthority) -> None:
    """A process of its own, with the image's Python (here the venv's), exit status 0."""
    server_files = authority.server(by_ip=False, dns_name="localhost")
    server = HealthServer(server_files.cert_file, server_files.key_file)
    server.set("", True)
    try:
        command = [sys.executable, str(PROBE), f"--port={server.port}"]
        result = subprocess.run(
            [*command, f"--ca-file={authority.cert_file}"], capture_output=True, text=True
        )
        assert result.returncode == 0, result.stderr
    finally:
        server.server.stop(None)


def test_without_tls_the_kubelet_probes_itself(rendered: dict[str, list[Document]]) -> None:
    """deploy/no-tls: the kubelet's own gRPC probes, no certificates, no probe script."""
    documents = rendered["no-tls"]
    probe_scripts = [c for c in of_kind(documents, "ConfigMap") if "health_probe.py" in c["data"]]
    assert not probe_scripts
    for deployment in of_kind(documents, "Deployment"):
        spec = pod_spec(deployment)
        assert not [v for v in spec["volumes"] if "secret" in v], deployment["metadata"]["name"]
        (container,) = spec["containers"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if probe in container:
                assert "exec" not in container[probe], probe
                assert container[probe].get("httpGet", {}).get("scheme", "HTTP") == "HTTP"


def secret_mounts(deployment: Document) -> dict[str, tuple[str, set[str] | None]]:
    """Mount path -> the Secret there and the keys it projects (None: all)."""
    found = {}
    for path, volume in mounts(deployment).items():
        if "secret" in volume:
            items = volume["secret"].get("items")
            keys = None if items is None else {item["key"] for item in items}
            found[path] = (volume["secret"]["secretName"], keys)
    return found


def tls_files(deployment: Document) -> dict[str, tuple[str, str]]:
    """Each TLS file the container's environment names -> (its Secret, the key)."""
    (container,) = pod_spec(deployment)["containers"]
    secrets = secret_mounts(deployment)
    files = {}
    for item in container.get("env", []):
        if item["name"].endswith("_FILE"):
            directory, _, key = item["value"].rpartition("/")
            secret, keys = secrets[directory]
            assert keys is None or key in keys, item
            files[item["name"]] = (secret, key)
    return files


def test_tls_files_are_keys_of_the_secrets_cert_manager_issues(
    rendered: dict[str, list[Document]],
) -> None:
    """Every TLS file a container reads is a key of a kubernetes.io/tls Secret mounted there;
    deploy/cert-manager issues every such Secret, and no other."""
    documents = rendered["cert-manager"]
    issued = {c["spec"]["secretName"] for c in of_kind(documents, "Certificate")}
    used = set()
    for deployment in of_kind(documents, "Deployment"):
        for secret, key in tls_files(deployment).values():
            assert key in {"tls.crt", "tls.key", "ca.crt"}
            used.add(secret)
    assert used == issued - {"llm-completions-ca"}  # the CA's own key stays in its Secret
    # The probes trust the CA of the pod's own certificate.
    for deployment in of_kind(documents, "Deployment"):
        secrets = secret_mounts(deployment)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            (container,) = pod_spec(deployment)["containers"]
            if "exec" not in container.get(probe, {}):
                continue
            (ca,) = [a for a in probe_arguments(container, probe) if a.startswith("--ca-file=")]
            directory, _, key = ca.removeprefix("--ca-file=").rpartition("/")
            assert key == "ca.crt" and secrets[directory][1] is None, deployment["metadata"]


def test_namespaces_agree(rendered: dict[str, list[Document]]) -> None:
    """Every document of an overlay in its one namespace (components that add resources name
    it again, and must name the same)."""
    for overlay, documents in rendered.items():
        (namespace,) = of_kind(documents, "Namespace")
        namespaces = {d["metadata"].get("namespace") for d in documents if d is not namespace}
        assert namespaces == {namespace["metadata"]["name"]}, overlay


# Last: checkov ran meanwhile.
def test_checkov_finds_nothing(checkov: subprocess.Popen[str] | None) -> None:
    """Every check passes on every overlay, those skipped above (with their reasons) excepted."""
    if checkov is None:
        pytest.skip(f"checkov is not installed in {CHECKOV.parent.parent}: run `make unit`")
    stdout, stderr = checkov.communicate(timeout=120)
    assert stdout, stderr
    report = json.loads(stdout)  # one framework: one report
    summary = report["summary"]
    assert summary["parsing_errors"] == 0 and summary["resource_count"] > 0, summary
    failed = sorted(
        {
            f"{check['check_id']} {check['resource']} ({check['check_name']})"
            for check in report["results"]["failed_checks"]
        }
    )
    assert not failed, "\n".join(failed)
    assert summary["passed"] > 0


FRONTEND_PORT_NAMES = ("frontend-0", "frontend-1")


def frontend_ports(replicas: Document) -> list[int]:
    """The ports Envoy, the picker and a gateway reach a replica's frontends on: each
    frontend's own, or the service's port with one frontend (API_SERVER_COUNT)."""
    (container,) = pod_spec(replicas)["containers"]
    env = {item["name"]: item.get("value") for item in container["env"]}
    ports = container_ports(replicas)
    if int(env.get("API_SERVER_COUNT") or 1) == 1:
        return [ports["grpc"]]
    return [ports[name] for name in FRONTEND_PORT_NAMES[: int(env["API_SERVER_COUNT"])]]


def test_envoy_and_the_picker_reach_every_frontend_of_a_replica(
    rendered: dict[str, list[Document]],
) -> None:
    """Their --upstream (or --pool) replicas end in the replicas' frontend ports, HOST:P+P."""
    for overlay, documents in rendered.items():
        (ports,) = {tuple(frontend_ports(replicas)) for replicas in replica_deployments(documents)}
        (config,) = [c for c in of_kind(documents, "ConfigMap") if "ports" in c.get("data", {})]
        assert config["data"]["ports"] == "+".join(map(str, ports)), overlay
        for name in ("llm-completions-envoy", "llm-completions-picker"):
            (container,) = pod_spec(named(documents, "Deployment", name))["containers"]
            replicas = [a for a in container["args"] if a.startswith(("--upstream=", "--pool="))]
            assert replicas and all(a.endswith(":$(REPLICA_PORTS)") for a in replicas), overlay
            (source,) = [e for e in container["env"] if e["name"] == "REPLICA_PORTS"]
            assert source["valueFrom"]["configMapKeyRef"]["name"] == config["metadata"]["name"]


def strict(schema: Any) -> Any:
    """The CRD's schema as the API server applies it with strict field validation: a field it
    does not declare is an error (jsonschema would let it pass)."""
    if isinstance(schema, dict):
        found = {key: strict(value) for key, value in schema.items()}
        if "properties" in found and "additionalProperties" not in found:
            found["additionalProperties"] = False
        return found
    if isinstance(schema, list):
        return [strict(value) for value in schema]
    return schema


def test_the_inference_pool_is_its_crds_and_the_fleets(
    rendered: dict[str, list[Document]],
) -> None:
    """deploy/inference-gateway: the InferencePool validates against the CRD's schema, selects
    the replica pods, lists their frontends' ports, and names our picker's Service and port;
    the gateway's route sends the service's calls to it, and its proxies may reach both."""
    documents = rendered["inference-gateway"]
    crd = yaml.safe_load(INFERENCE_POOL_CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = strict(version["schema"]["openAPIV3Schema"])
    (pool,) = of_kind(documents, "InferencePool")
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(pool), key=str)
    assert not errors, [f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors]
    spec = pool["spec"]
    (replicas,) = replica_deployments(documents)
    assert selects(spec["selector"]["matchLabels"], pod_labels(replicas))
    assert [port["number"] for port in spec["targetPorts"]] == frontend_ports(replicas)
    assert spec["appProtocol"] == "kubernetes.io/h2c"  # gRPC in cleartext (no TLS)
    picker_service = named(documents, "Service", spec["endpointPickerRef"]["name"])
    assert spec["endpointPickerRef"]["port"]["number"] in [
        port["port"] for port in picker_service["spec"]["ports"]
    ]
    (route,) = of_kind(documents, "HTTPRoute")
    (gateway,) = of_kind(documents, "Gateway")
    assert route["spec"]["parentRefs"][0]["name"] == gateway["metadata"]["name"]
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "llm-completions"}
    ]
    assert rule["matches"][0]["path"]["value"] == "/llmcompletions.v2.CompletionService/"
    proxies = {
        "spec": {
            "template": {
                "metadata": {
                    "labels": {
                        "gateway.networking.k8s.io/gateway-name": gateway["metadata"]["name"]
                    }
                }
            }
        }
    }
    picker = named(documents, "Deployment", "llm-completions-picker")
    assert reachable(documents, picker, "picker", proxies)
    for port in FRONTEND_PORT_NAMES:
        assert reachable(documents, replicas, port, proxies)
    assert not reachable(documents, replicas, "grpc", replicas)


def test_tenants_reach_every_replica_from_a_secret_and_one_store_only_they_reach(
    rendered: dict[str, list[Document]],
) -> None:
    """deploy/tenants: the tenants file is the Secret's key, mounted as a directory (so that
    edits reach running replicas); the limits store is the Redis Service, which only the
    replicas may reach."""
    documents = rendered["tenants"]
    (replicas,) = replica_deployments(documents)
    (container,) = pod_spec(replicas)["containers"]
    env = {item["name"]: item.get("value") for item in container["env"]}
    tenants_file = Path(env["TENANTS_FILE"])
    volume = mounts(replicas)[str(tenants_file.parent)]
    assert volume["secret"]["secretName"] == "llm-completions-tenants"
    assert "items" not in volume["secret"]  # the whole Secret: updated in place by the kubelet
    store = named(documents, "Service", "llm-completions-limits")
    assert (
        env["LIMITS_STORE"]
        == f"redis://{store['metadata']['name']}:{store['spec']['ports'][0]['port']}"
    )
    redis = named(documents, "Deployment", "llm-completions-limits")
    assert selects(store["spec"]["selector"], pod_labels(redis))
    assert reachable(documents, redis, "redis", replicas)
    envoy = named(documents, "Deployment", "llm-completions-envoy")
    assert not reachable(documents, redis, "redis", envoy)
