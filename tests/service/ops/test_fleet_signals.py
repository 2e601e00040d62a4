"""The gauges a fleet routes and scales on (docs/scale-out.md), read from a real server's
/metrics: every metric the fleet's manifests name exists with its documented type, and the
queued and running requests and the batch utilization of a model rise while its work waits
and runs, stay at zero for the model beside it, and come back to zero once it is answered.

One server per layout: one process (--frontends 0, where /metrics counts the queues when
read) and two front ends (--frontends 2, where the engine process publishes its counts to
the supervisor's endpoint), each serving the shipped MiniLM and a tiny random BERT.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pooling_client.v1 import pooling_pb2 as pb
from pooling_client.v1 import pooling_pb2_grpc
from pooling_server.engine.scheduling.batch_queue import BatchConfig, BatchRecord
from pooling_server.service.ops.metrics import UTILIZATION_WINDOW_S, BatchUtilization, batch_fill
from tests.conftest import DEFAULT_MODEL
from tests.deploy import fleet_files as fleet
from tests.server_process import ServerProcess, free_port, start_server

OTHER_MODEL = "tiny-bert"
QUEUED, RUNNING, UTILIZATION = (
    "pooling_requests_queued",
    "pooling_requests_running",
    "pooling_batch_utilization",
)
# Two requests of this many short texts on one connection: the engine takes a client's
# oldest items first, so the second waits whole while the first runs (a few seconds).
TEXTS = 400
# An engine process publishes its counts every 0.25 s; a scrape may predate the last.
SETTLE_S = 5.0


@dataclass
class Family:
    type: str
    values: dict[str, float] = field(default_factory=dict)  # model label -> value


def scrape_families(port: int) -> dict[str, Family]:
    """Metric family name -> its Prometheus type and, for gauges, the value by model."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    families = {}
    for family in text_string_to_metric_families(text):
        found = families[family.name] = Family(family.type)
        for sample in family.samples:
            if sample.name == family.name and "model" in sample.labels:
                found.values[sample.labels["model"]] = sample.value
    return families


@dataclass
class Fleet:
    process: ServerProcess
    metrics_port: int

    def gauges(self) -> dict[str, dict[str, float]]:
        families = scrape_families(self.metrics_port)
        return {name: families[name].values for name in (QUEUED, RUNNING, UTILIZATION)}

    def wait_for(self, check: Any, timeout: float) -> dict[str, dict[str, float]]:
        """Scrape until `check(gauges)` holds; the last gauges either way."""
        deadline = time.monotonic() + timeout
        while True:
            gauges = self.gauges()
            if check(gauges) or time.monotonic() > deadline:
                return gauges
            time.sleep(0.05)


@pytest.fixture(scope="module", params=["0", "2"], ids=lambda n: f"frontends-{n}")
def fleet_server(
    request: pytest.FixtureRequest,
    model_folders: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Fleet]:
    metrics_port = free_port()
    args = ["--model", DEFAULT_MODEL, "--model", f"{OTHER_MODEL}={model_folders['tiny-bert']}"]
    args += ["--dtype", "float32", "--frontends", request.param]
    args += ["--metrics-port", str(metrics_port)]
    process = start_server(args, tmp_path_factory.mktemp("fleet-logs"), f"fleet-{request.param}")
    try:
        yield Fleet(process, metrics_port)
    finally:
        process.stop(signal.SIGTERM)


def both_models_idle(gauges: dict[str, dict[str, float]]) -> bool:
    return all(
        gauges[name].get(model) == 0.0
        for name in (QUEUED, RUNNING, UTILIZATION)
        for model in (DEFAULT_MODEL, OTHER_MODEL)
    )


def test_every_metric_the_manifests_name_is_served_with_its_documented_type(
    fleet_server: Fleet,
) -> None:
    fleet_server.wait_for(both_models_idle, SETTLE_S)  # an engine's first publication
    families = scrape_families(fleet_server.metrics_port)
    documented = fleet.documented_types()
    for name, where in fleet.named_metrics().items():
        assert name in families, f"{name} ({where}) is not in /metrics"
        assert families[name].type == documented[name], (name, where)
    # The picker reads the series its spec's labels pick: the served default model's.
    for field_name, (name, labels) in fleet.picker_specs().items():
        assert labels["model"] in families[name].values, (field_name, families[name].values)


def test_gauges_are_per_model_and_zero_when_idle(fleet_server: Fleet) -> None:
    gauges = fleet_server.wait_for(both_models_idle, SETTLE_S)
    for name in (QUEUED, RUNNING, UTILIZATION):
        assert gauges[name] == {DEFAULT_MODEL: 0.0, OTHER_MODEL: 0.0}, name


def embed(texts: list[str]) -> pb.PoolRequest:
    return pb.PoolRequest(model=DEFAULT_MODEL, embed=pb.TextInput(texts=texts))


def test_gauges_rise_while_work_waits_and_runs_then_return_to_zero(fleet_server: Fleet) -> None:
    fleet_server.wait_for(both_models_idle, SETTLE_S + UTILIZATION_WINDOW_S)
    texts = [f"text {i} about a quiet harbour at dawn" for i in range(TEXTS)]
    seen: list[dict[str, dict[str, float]]] = []
    with grpc.insecure_channel(fleet_server.process.address) as channel:
        stub = pooling_pb2_grpc.PoolingServiceStub(channel)
        calls: list[Future[Any]] = [stub.Pool.future(embed(texts), timeout=300) for _ in range(2)]
        deadline = time.monotonic() + 300
        while not all(call.done() for call in calls) and time.monotonic() < deadline:
            seen.append(fleet_server.gauges())
            time.sleep(0.05)
        for call in calls:
            assert len(call.result().embed.embeddings) == TEXTS
    queued = [g[QUEUED][DEFAULT_MODEL] for g in seen]
    running = [g[RUNNING][DEFAULT_MODEL] for g in seen]
    busy = [g[UTILIZATION][DEFAULT_MODEL] for g in seen]
    # Two requests, one running while the other waits whole (its client's older items first).
    assert any(q == 1 and r == 1 for q, r in zip(queued, running, strict=True)), (queued, running)
    # Requests are counted, not their texts: never more than the two sent.
    assert max(q + r for q, r in zip(queued, running, strict=True)) <= 2
    assert 0 < max(busy) <= 1, busy
    for gauges in seen:  # the model beside it did nothing
        assert all(gauges[name].get(OTHER_MODEL, 0.0) == 0.0 for name in gauges), gauges
    after = fleet_server.wait_for(
        lambda g: g[QUEUED][DEFAULT_MODEL] == g[RUNNING][DEFAULT_MODEL] == 0, SETTLE_S
    )
    assert after[QUEUED][DEFAULT_MODEL] == after[RUNNING][DEFAULT_MODEL] == 0, after
    # The utilization covers the last window's passes; one window after the last, none.
    after = fleet_server.wait_for(both_models_idle, UTILIZATION_WINDOW_S + SETTLE_S)
    assert both_models_idle(after), after


# --------------------------------------------------------------------------- utilization


def record(size: int, padded: int, seconds: float) -> BatchRecord:
    return BatchRecord(size, padded, padded, [0.0] * size, seconds, None)


def test_batch_fill_is_the_fuller_of_the_two_limits() -> None:
    config = BatchConfig(max_batch_tokens=1000, max_batch_size=10)
    assert batch_fill(record(5, 100, 0.1), config) == 0.5  # items
    assert batch_fill(record(2, 800, 0.1), config) == 0.8  # tokens
    assert batch_fill(record(1, 4000, 0.1), config) == 1.0  # an anchor over the budget


def test_utilization_weights_pass_time_by_fill_over_window_and_workers() -> None:
    meter = BatchUtilization(window_s=10.0)
    meter.track("m", BatchConfig(max_batch_tokens=1000, max_batch_size=10, workers=2))
    meter.record("m", record(10, 100, 4.0), now=100.0)  # full: 4 s
    meter.record("m", record(5, 100, 2.0), now=104.0)  # half full: 1 s
    assert meter.value("m", now=104.0) == pytest.approx(5.0 / (10.0 * 2))
    # A pass partly out of the window counts its part inside: the first pass (96 s to
    # 100 s) has 1 s left in 99 s to 109 s.
    assert meter.value("m", now=109.0) == pytest.approx((1.0 + 1.0) / 20)
    assert meter.value("m", now=114.5) == 0.0  # both passes ended over a window ago
    assert meter.value("unknown") == 0.0
    meter.record("m", record(10, 1000, 60.0), now=200.0)  # back to back past the window
    assert meter.value("m", now=200.0) == 0.5  # one of two workers
