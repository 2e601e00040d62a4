"""Offline checks of deploy/kubernetes/fleet: the InferencePool, its endpoint picker's
configuration, the HTTPRoute and the KEDA ScaledObject.

kubernetes-validate has no schemas for custom resources (InferencePool, HTTPRoute,
ScaledObject), so those are checked here field by field against the APIs they target
(inference.networking.k8s.io/v1, gateway.networking.k8s.io/v1, keda.sh/v1alpha1), and
against the base manifests they must agree with; what is a core object (the ConfigMap, and
the HPA behaviour the ScaledObject hands to the HPA it makes) goes through the schemas.
That the metrics they name exist, with the documented types, in a real server's /metrics is
tests/service/ops/test_fleet_signals.py's.
"""

from __future__ import annotations

import re
from typing import Any

import kubernetes_validate
import pytest
import yaml

from pooling_server.service.cli import build_parser, config_from_args
from pooling_server.service.server import SERVICE_NAME
from tests.deploy import fleet_files as fleet
from tests.deploy.test_manifests import (
    K8S_VERSIONS,
    QUANTITY,
    container_port,
    load_one,
    pod_labels,
    selects,
    service_ports,
)

H2C = "kubernetes.io/h2c"
GAUGES = {"pooling_requests_queued", "pooling_requests_running", "pooling_batch_utilization"}


@pytest.fixture(scope="module")
def deployment() -> dict[str, Any]:
    return load_one("deployment.yaml")


@pytest.fixture(scope="module")
def container(deployment: dict[str, Any]) -> dict[str, Any]:
    [found] = deployment["spec"]["template"]["spec"]["containers"]
    return found


@pytest.fixture(scope="module")
def default_model(container: dict[str, Any]) -> str:
    """The name the Deployment's pods serve their first model under, as the server reads
    their arguments (no --model: the server's default model)."""
    config = config_from_args(build_parser().parse_args(container["args"]))
    return config.models[0].served_name


def test_kustomization_adds_the_fleet_to_the_base_and_drops_the_cpu_hpa() -> None:
    kustomization = fleet.one("kustomization.yaml")
    resources = kustomization["resources"]
    assert resources[0] == "..", "the fleet is the base plus these objects"
    files = sorted(p.name for p in fleet.FLEET.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(resources[1:]) == files
    [patch] = kustomization["patches"]
    deleted = yaml.safe_load(patch["patch"])
    hpa = load_one("hpa.yaml")
    assert deleted["$patch"] == "delete"
    assert (deleted["kind"], deleted["metadata"]["name"]) == (
        hpa["kind"],
        hpa["metadata"]["name"],
    ), "KEDA's HPA and the base's would fight over the replica count"


def test_inference_pool(deployment: dict[str, Any], container: dict[str, Any]) -> None:
    pool = fleet.one("inferencepool.yaml")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["kind"] == "InferencePool"
    spec = pool["spec"]
    assert set(spec) <= {"selector", "targetPorts", "appProtocol", "endpointPickerRef"}
    assert set(spec["selector"]) == {"matchLabels"}
    assert selects(spec["selector"]["matchLabels"], pod_labels(deployment))
    assert spec["targetPorts"] == [{"number": container_port(container, "grpc")}]
    # The pool's enum is http or kubernetes.io/h2c; gRPC needs HTTP/2.
    assert spec["appProtocol"] == H2C
    ref = spec["endpointPickerRef"]
    assert set(ref) <= {"group", "kind", "name", "port", "failureMode"}
    assert ref.get("kind", "Service") == "Service" and ref.get("group", "") == ""
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", ref["name"])
    assert 1 <= ref["port"]["number"] <= 65535, "a Service reference needs its port"
    assert ref.get("failureMode", "FailClose") in ("FailOpen", "FailClose")


def test_services_speak_h2c_like_the_pool() -> None:
    for name in ("service.yaml", "service-headless.yaml"):
        grpc = service_ports(load_one(name))["grpc"]
        assert grpc["appProtocol"] == fleet.one("inferencepool.yaml")["spec"]["appProtocol"]


def test_http_route_sends_the_pooling_service_to_the_pool() -> None:
    route = fleet.one("httproute.yaml")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["kind"] == "HTTPRoute"
    pool = fleet.one("inferencepool.yaml")
    [rule] = route["spec"]["rules"]
    [backend] = rule["backendRefs"]
    assert backend == {
        "group": "inference.networking.k8s.io",
        "kind": "InferencePool",
        "name": pool["metadata"]["name"],
    }
    [match] = rule["matches"]
    assert match["path"] == {"type": "PathPrefix", "value": f"/{SERVICE_NAME}/"}
    assert route["spec"]["parentRefs"][0]["kind"] == "Gateway"


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_picker_configmap_matches_kubernetes_schema(version: str) -> None:
    kubernetes_validate.validate(fleet.one("endpoint-picker.yaml"), version, strict=True)


def test_picker_config_is_consistent(container: dict[str, Any]) -> None:
    config = fleet.picker_config()
    assert config["kind"] == "EndpointPickerConfig"
    assert config["apiVersion"] in ("llm-d.ai/v1alpha1", "inference.networking.x-k8s.io/v1alpha1")
    names = [p.get("name", p["type"]) for p in config["plugins"]]
    assert len(names) == len(set(names)), "plugin names must be unique"
    refs = [
        *(p["pluginRef"] for profile in config["schedulingProfiles"] for p in profile["plugins"]),
        *(s["pluginRef"] for s in config["dataLayer"]["sources"]),
        *(e["pluginRef"] for s in config["dataLayer"]["sources"] for e in s["extractors"]),
        *(p["pluginRef"] for p in config["requestHandler"]["parsers"]),
    ]
    assert set(refs) <= set(names), f"references to no plugin: {set(refs) - set(names)}"
    # The picker scrapes each pod's metrics port, not the pool's gRPC port.
    source = fleet.plugin(config, "metrics-data-source")["parameters"]
    assert source["port"] == container_port(container, "metrics")
    assert source["path"] == "/metrics"
    # gRPC bodies are not OpenAI JSON: only the parser that reads nothing can pass them.
    assert [p["pluginRef"] for p in config["requestHandler"]["parsers"]] == ["passthrough-parser"]
    scored = {p["pluginRef"] for p in config["schedulingProfiles"][0]["plugins"]}
    assert {"queue-scorer", "running-requests-size-scorer", "kv-cache-utilization-scorer"} <= scored


def test_picker_reads_the_three_gauges_of_the_default_model(default_model: str) -> None:
    specs = fleet.picker_specs()
    assert {name for name, _ in specs.values()} == GAUGES
    assert specs["queuedRequestsSpec"][0] == "pooling_requests_queued"
    assert specs["runningRequestsSpec"][0] == "pooling_requests_running"
    assert specs["kvUsageSpec"][0] == "pooling_batch_utilization"
    # The picker keeps one series a gauge: each spec picks the model this pool routes.
    for name, labels in specs.values():
        assert labels == {"model": default_model}, name
    engine = fleet.engine_config(fleet.picker_config())
    assert engine["loraSpec"] == "" and engine["cacheInfoSpec"] == "", "no LoRA, no KV cache"


def test_parse_spec_reads_what_the_picker_reads() -> None:
    assert fleet.parse_spec("a_b{model=x/y-1.2,k=v}") == ("a_b", {"model": "x/y-1.2", "k": "v"})
    assert fleet.parse_spec("vllm:num_requests_waiting") == ("vllm:num_requests_waiting", {})
    with pytest.raises(AssertionError):
        fleet.parse_spec('a{model="x"')


def test_scaled_object(deployment: dict[str, Any]) -> None:
    scaled = fleet.one("scaledobject.yaml")
    assert (scaled["apiVersion"], scaled["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
    spec = scaled["spec"]
    target = spec["scaleTargetRef"]
    assert target == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "pooling-server"}
    assert target["name"] == deployment["metadata"]["name"]
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    triggers = spec["triggers"]
    assert triggers and all(t["type"] == "prometheus" for t in triggers)
    assert len({t["name"] for t in triggers}) == len(triggers)
    for trigger in triggers:
        meta = trigger["metadata"]
        assert trigger.get("metricType", "AverageValue") == "AverageValue"
        assert meta["serverAddress"].startswith(("http://", "https://"))
        assert QUANTITY.fullmatch(meta["threshold"]) and float(meta["threshold"]) > 0
        # An average target: the query must be the fleet's total, so a sum.
        assert meta["query"].startswith("sum(")
    names = {name for t in triggers for name in fleet.OUR_METRIC.findall(t["metadata"]["query"])}
    assert "pooling_queue_depth" in names, "the fleet scales on its queue"


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_scaled_object_hpa_behaviour_matches_schema(version: str) -> None:
    """KEDA copies `advanced.horizontalPodAutoscalerConfig.behavior` into the HPA it makes."""
    behavior = fleet.one("scaledobject.yaml")["spec"]["advanced"]["horizontalPodAutoscalerConfig"]
    hpa = load_one("hpa.yaml")
    hpa["spec"]["behavior"] = behavior["behavior"]
    kubernetes_validate.validate(hpa, version, strict=True)


def test_every_named_metric_is_documented_with_its_type() -> None:
    documented = fleet.documented_types()
    named = fleet.named_metrics()
    assert set(named) >= GAUGES
    for name, where in named.items():
        assert documented.get(name) == "gauge", f"{name} ({where}) is not a documented gauge"
    operations = (fleet.REPO / "docs" / "operations.md").read_text()
    for name in GAUGES:
        assert f"`{name}" in operations, f"docs/operations.md does not name {name}"
