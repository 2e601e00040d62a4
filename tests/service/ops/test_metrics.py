"""service/ops/metrics.py's bulk histogram update against prometheus_client's own observe."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram

from pooling_server.service.ops.metrics import LATENCY_BUCKETS, observe_many


def _samples(histogram: Histogram) -> dict[tuple[str, str], float]:
    [family] = histogram.collect()
    return {
        (s.name, s.labels.get("le", "")): s.value for s in family.samples if "created" not in s.name
    }


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_observe_many_counts_as_observe_does(seed: int) -> None:
    rng = random.Random(seed)
    bounds = [b for b in LATENCY_BUCKETS if b != float("inf")]
    # Amounts on every bound exactly, between them, below the first and past the last.
    amounts = [*bounds, 0.0, -1.0, bounds[-1] * 10]
    amounts += [rng.uniform(0, bounds[-1] * 1.5) for _ in range(500)]
    one = Histogram("one", "one by one", ["model"], buckets=LATENCY_BUCKETS, registry=None)
    many = Histogram("one", "all at once", ["model"], buckets=LATENCY_BUCKETS, registry=None)
    for amount in amounts:
        one.labels("m").observe(amount)
    observe_many(many.labels("m"), amounts[:100])
    observe_many(many.labels("m"), amounts[100:])
    observe_many(many.labels("m"), [])
    want, got = _samples(one), _samples(many)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value), key
    assert want[("one_count", "")] == len(amounts)


def test_an_unlabelled_histogram_in_a_registry_reads_as_observed() -> None:
    registry = CollectorRegistry()
    histogram = Histogram("waits", "w", buckets=[0.1, 1.0], registry=registry)
    observe_many(histogram, [0.05, 0.1, 0.5, 2.0])
    assert registry.get_sample_value("waits_bucket", {"le": "0.1"}) == 2
    assert registry.get_sample_value("waits_bucket", {"le": "1.0"}) == 3
    assert registry.get_sample_value("waits_bucket", {"le": "+Inf"}) == 4
    assert registry.get_sample_value("waits_sum") == pytest.approx(2.65)
