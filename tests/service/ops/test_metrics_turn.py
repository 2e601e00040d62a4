"""A split server's front end counts the requests of one event-loop turn together: the
series read after the turn as they would after each request counted one by one, and a
request finished off the loop is counted at once."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest

from pooling_server.engine.scheduling.engine import Timings
from pooling_server.service.ops.metrics import Metrics
from tests.service.ops.test_metrics import _samples

# (rpc, task, model, code, protocol, ok, total_s, tokenize_s, items, tokens)
Request = tuple[str, str, str, str, str, bool | None, float, float, int, int]


def _requests(seed: int, count: int) -> list[Request]:
    rng = random.Random(seed)
    return [
        (
            rng.choice(["Pool", "Rerank"]),
            rng.choice(["embed", "classify"]),
            rng.choice(["a", "b"]),
            rng.choice(["OK", "OK", "INVALID_ARGUMENT"]),
            rng.choice(["grpc", "http"]),
            rng.choice([None, None, False]),
            rng.uniform(0, 0.3),
            rng.uniform(0, 0.01),
            rng.randint(1, 8),
            rng.randint(1, 500),
        )
        for _ in range(count)
    ]


def _observe(metrics: Metrics, request: Request) -> None:
    rpc, task, model, code, protocol, ok, total_s, tokenize_s, items, tokens = request
    timings = Timings()
    timings.total_s, timings.tokenize_s = total_s, tokenize_s
    metrics.observe_request(rpc, task, model, code, timings, items, tokens, protocol, ok)


def _series(metrics: Metrics) -> dict[tuple[str, str], float]:
    out: dict[tuple[str, str], float] = {}
    for metric in (metrics.requests, metrics.items, metrics.tokens):
        for sample in next(iter(metric.collect())).samples:
            if not sample.name.endswith("_created"):
                out[(sample.name, repr(sorted(sample.labels.items())))] = sample.value
    for histogram in (metrics.request_seconds, metrics.tokenize_seconds):
        for key, value in _samples(histogram).items():
            out[key] = out.get(key, 0.0) + value
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_a_turns_requests_read_as_counted_one_by_one(seed: int) -> None:
    requests = _requests(seed, 300)
    one_by_one = Metrics()
    for request in requests:
        _observe(one_by_one, request)
    by_turn = Metrics(multiprocess=True)

    async def serve() -> None:
        for start in range(0, len(requests), 37):
            for request in requests[start : start + 37]:
                _observe(by_turn, request)
            await asyncio.sleep(0)
        await asyncio.sleep(0)

    asyncio.run(serve())
    want, got = _series(one_by_one), _series(by_turn)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value), key


def test_counted_at_the_turns_end_and_off_the_loop_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    metrics = Metrics(multiprocess=True)
    writes: list[int] = []
    count = metrics._count
    monkeypatch.setattr(metrics, "_count", lambda r, i, t: (writes.append(len(r)), count(r, i, t)))
    request = ("Pool", "embed", "m", "OK", "grpc", None, 0.01, 0.001, 1, 5)
    seen: list[float] = []

    async def serve() -> None:
        for _ in range(5):
            _observe(metrics, request)
        seen.append(metrics.requests.labels("Pool", "embed", "m", "OK", "grpc")._value.get())
        await asyncio.sleep(0)
        seen.append(metrics.requests.labels("Pool", "embed", "m", "OK", "grpc")._value.get())

    asyncio.run(serve())
    assert seen == [0, 5] and writes == [5]
    thread = threading.Thread(target=_observe, args=(metrics, request))
    thread.start()
    thread.join()
    assert seen[-1] + 1 == metrics.requests.labels("Pool", "embed", "m", "OK", "grpc")._value.get()
    asyncio.run(serve())  # a new loop: the first one is closed
    assert seen[-2:] == [6, 11] and writes == [5, 5]
