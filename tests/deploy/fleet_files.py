"""The fleet manifests (deploy/kubernetes/fleet) read as data: the endpoint picker's metric
specs, the scaler's queries and every metric they name, and the types docs/scale-out.md
gives them. Used by the offline checks (tests/deploy/test_fleet.py) and by the check
against a real server's /metrics (tests/service/ops/test_fleet_signals.py)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "kubernetes"
FLEET = K8S / "fleet"
SCALE_OUT_DOC = REPO / "docs" / "scale-out.md"

# A metric as the endpoint picker names one: `name` or `name{label=value,...}`, unquoted.
PICKER_SPEC = re.compile(r"(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^{}]+)\})?")
# The server's own names, wherever a manifest or a query mentions one.
OUR_METRIC = re.compile(r"\bpooling_[a-z_]+\b")
# A documented metric: a table row "| `name` | type | ...".
DOC_ROW = re.compile(r"^\|\s*`(?P<name>pooling_[a-z_]+)`\s*\|\s*(?P<type>[a-z]+)\s*\|", re.M)

SPEC_FIELDS = ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec")


def load(name: str) -> list[dict[str, Any]]:
    docs = [doc for doc in yaml.safe_load_all((FLEET / name).read_text()) if doc is not None]
    assert docs and all(isinstance(doc, dict) for doc in docs), name
    return docs


def one(name: str) -> dict[str, Any]:
    [doc] = load(name)
    return doc


def picker_config() -> dict[str, Any]:
    """The EndpointPickerConfig held in the picker's ConfigMap."""
    configmap = one("endpoint-picker.yaml")
    [text] = configmap["data"].values()
    config = yaml.safe_load(text)
    assert isinstance(config, dict)
    return config


def plugin(config: dict[str, Any], kind: str) -> dict[str, Any]:
    [found] = [p for p in config["plugins"] if p["type"] == kind]
    return found


def engine_config(config: dict[str, Any]) -> dict[str, Any]:
    """The metrics extractor's entry for the engine its pods are read as by default."""
    parameters = plugin(config, "core-metrics-extractor")["parameters"]
    [engine] = [e for e in parameters["engineConfigs"] if e["name"] == parameters["defaultEngine"]]
    return engine


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """A picker metric spec as the picker reads it: a name, then label=value pairs."""
    match = PICKER_SPEC.fullmatch(spec.strip())
    assert match, f"not a metric spec the picker can read: {spec!r}"
    labels = {}
    for pair in (match["labels"] or "").split(","):
        if pair.strip():
            key, sep, value = pair.partition("=")
            assert sep and "=" not in value, f"bad label pair {pair!r} in {spec!r}"
            labels[key.strip()] = value.strip()
    return match["name"], labels


def picker_specs() -> dict[str, tuple[str, dict[str, str]]]:
    """The three gauges the picker reads, by its field name."""
    engine = engine_config(picker_config())
    return {field: parse_spec(engine[field]) for field in SPEC_FIELDS}


def scaler_queries() -> list[str]:
    scaled = one("scaledobject.yaml")
    return [t["metadata"]["query"] for t in scaled["spec"]["triggers"]]


def named_metrics() -> dict[str, str]:
    """Every pooling_* metric the fleet's manifests name, and where (for messages)."""
    named: dict[str, str] = {}
    for field, (name, _labels) in picker_specs().items():
        named.setdefault(name, f"endpoint-picker.yaml {field}")
    for query in scaler_queries():
        for name in OUR_METRIC.findall(query):
            named.setdefault(name, f"scaledobject.yaml {query!r}")
    for name in OUR_METRIC.findall((K8S / "hpa.yaml").read_text()):
        named.setdefault(name, "hpa.yaml")
    return named


def documented_types() -> dict[str, str]:
    """Metric name -> Prometheus type, from docs/scale-out.md's table."""
    return {m["name"]: m["type"] for m in DOC_ROW.finditer(SCALE_OUT_DOC.read_text())}
