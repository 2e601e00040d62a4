"""Reading a server's Prometheus endpoint in tests and benchmarks."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable
from typing import Any

from prometheus_client.parser import text_string_to_metric_families


def scrape(port: int) -> dict[str, list[Any]]:
    """Sample name -> samples from the server's /metrics on loopback."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    samples: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def metric_sum(samples: dict[str, list[Any]], name: str, **labels: str) -> float:
    """The sum of a sample's values over every series whose labels include `labels`."""
    return sum(
        s.value
        for s in samples.get(name, [])
        if all(s.labels.get(k) == v for k, v in labels.items())
    )


def metric_growth(
    before: dict[str, list[Any]], after: dict[str, list[Any]], name: str
) -> Callable[..., float]:
    """delta(**labels): how much metric_sum(`name`, labels) grew between two scrapes."""

    def delta(**labels: str) -> float:
        return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)

    return delta
