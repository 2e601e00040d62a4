"""The result cache on a real server (--cache-mb, two API keys): answers with it equal
answers without it for every task and encoding; dimensions, use_activation and encodings
share one entry; usage counts cached tokens; 50 identical calls at once make one forward
pass; one key's entries are not another's; the bypass; /metrics."""

from __future__ import annotations

import json
import signal
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest

from pooling_client.v1 import pooling_pb2 as pb
from pooling_client.v1 import pooling_pb2_grpc
from tests.conftest import Served, server_args
from tests.fixture_models import MINILM, tiny_colbert
from tests.metrics_endpoint import metric_growth, metric_sum, scrape
from tests.server_process import ServerProcess, free_port, start_server
from tests.service.cache.answers import assert_same, outputs
from tests.service.doors_server import splade_folder

KEY_A, KEY_B = "cache-key-a", "cache-key-b"
LONG = "Late in the evening the harbour lights came on one by one. " * 12  # chunked


class Cached:
    def __init__(self, process: ServerProcess, http_port: int, metrics_port: int) -> None:
        self.process, self.http_port, self.metrics_port = process, http_port, metrics_port
        self.channel = grpc.insecure_channel(process.address)
        self.stub = pooling_pb2_grpc.PoolingServiceStub(self.channel)

    def pool(
        self, request: pb.PoolRequest, key: str = KEY_A, bypass: bool = False
    ) -> pb.PoolResponse:
        sent = pb.PoolRequest()
        sent.CopyFrom(request)
        if bypass:
            sent.params.bypass_cache = True
        return self.stub.Pool(sent, metadata=[("authorization", f"Bearer {key}")], timeout=60)


@pytest.fixture(scope="module")
def server(
    model_folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cached]:
    root = tmp_path_factory.mktemp("cache-served")
    models = [
        Served("minilm", str(MINILM)),
        Served("matryoshka", str(MINILM), hf_overrides={"is_matryoshka": True}),
        Served("classifier", str(model_folders["tiny-classifier"])),
        Served("cross", str(model_folders["tiny-cross-encoder"])),
        Served("ner", str(model_folders["tiny-ner"])),
        Served("chunk", str(model_folders["tiny-bert"]), "mean", long_input="chunk"),
        Served("splade", str(splade_folder(root)), "splade"),
        Served("colbert", str(tiny_colbert(root / "colbert"))),
    ]
    http_port, metrics_port = free_port(), free_port()
    args = [*server_args(models), "--dtype", "float32", "--cache-mb", "64"]
    args += ["--api-key", KEY_A, "--api-key", KEY_B, "--http-port", str(http_port)]
    args += ["--metrics-port", str(metrics_port)]
    process = start_server(args, root)
    served = Cached(process, http_port, metrics_port)
    yield served
    served.channel.close()
    process.stop(signal.SIGTERM)


def growth(
    server: Cached, before: dict[str, list[Any]], name: str, want: float, **labels: str
) -> float:
    """How much a cache counter grew since `before`, polled until it reaches `want` (an
    engine process copies its counts into /metrics every second) or 10 s pass."""
    deadline = time.monotonic() + 10
    while True:
        grew = metric_growth(before, scrape(server.metrics_port), name)(**labels)
        if grew >= want or time.monotonic() > deadline:
            return grew
        time.sleep(0.05)


def settled(server: Cached) -> dict[str, list[Any]]:
    """A scrape once the cache's counters have stopped moving: every earlier call's counts
    have reached /metrics (an engine process copies them there every 0.25 s)."""
    names = ("pooling_cache_misses_total", "pooling_cache_hits_total")
    deadline = time.monotonic() + 10
    last = scrape(server.metrics_port)
    while True:
        time.sleep(0.3)
        now = scrape(server.metrics_port)
        if all(metric_sum(now, n) == metric_sum(last, n) for n in names):
            return now
        assert time.monotonic() < deadline, "the cache's counters kept moving"
        last = now


def _texts(case: str) -> list[str]:
    return [f"{case}: the cat sat on the mat", f"{case}: a second, longer text about dogs"]


def _cases() -> list[tuple[str, pb.PoolRequest]]:
    cases = [
        ("embed", pb.PoolRequest(model="minilm", embed=pb.TextInput(texts=_texts("e")))),
        (
            "token_embed",
            pb.PoolRequest(model="minilm", token_embed=pb.TextInput(texts=_texts("t"))),
        ),
        ("classify", pb.PoolRequest(model="classifier", classify=pb.TextInput(texts=_texts("c")))),
        (
            "token_classify",
            pb.PoolRequest(model="ner", token_classify=pb.TextInput(texts=_texts("n"))),
        ),
        (
            "embed_sparse",
            pb.PoolRequest(model="splade", embed_sparse=pb.SparseInput(texts=_texts("s"))),
        ),
        (
            "embed_multi",
            pb.PoolRequest(model="colbert", embed_multi=pb.TextInput(texts=_texts("m"))),
        ),
        ("chunked", pb.PoolRequest(model="chunk", embed=pb.TextInput(texts=[LONG, "short"]))),
    ]
    pairs = pb.ScoreInput(text_1=["what sat on the mat?"], text_2=_texts("p"))
    cases += [
        ("score_cross", pb.PoolRequest(model="cross", score=pairs)),
        ("score_cosine", pb.PoolRequest(model="minilm", score=pairs)),
        ("score_maxsim", pb.PoolRequest(model="colbert", score=pairs)),  # folded per item
    ]
    for encoding in ("FLOAT16", "BFLOAT16", "INT8", "UINT8", "BINARY", "UBINARY", "FLOAT32"):
        value = getattr(pb, f"EMBEDDING_ENCODING_{encoding}")
        request = pb.PoolRequest(
            model="minilm", embed=pb.TextInput(texts=_texts("e")), encoding=value
        )
        cases.append((f"embed_{encoding.lower()}", request))
    return cases


@pytest.mark.parametrize(("case", "request_"), _cases(), ids=[c for c, _ in _cases()])
def test_answers_with_the_cache_equal_answers_without(
    server: Cached, case: str, request_: pb.PoolRequest
) -> None:
    want = server.pool(request_, bypass=True)
    assert want.usage.cached_tokens == 0
    server.pool(request_)  # computed (or found: encodings share embed's entry)
    again = server.pool(request_)
    assert again.usage.cached_tokens == again.usage.prompt_tokens > 0, case
    assert_same(outputs(again), outputs(want))


def test_dimensions_and_use_activation_share_one_entry(server: Cached) -> None:
    texts = ["one entry for every variant of this text"]
    plain = pb.PoolRequest(model="matryoshka", embed=pb.TextInput(texts=texts))
    first = server.pool(plain)
    assert first.usage.cached_tokens == 0
    variants = [
        pb.PoolRequest(model="matryoshka", embed=pb.TextInput(texts=texts), params=params)
        for params in (
            pb.PoolingParams(dimensions=64),
            pb.PoolingParams(use_activation=False),
            pb.PoolingParams(dimensions=128, use_activation=False),
        )
    ]
    for request in variants:
        got = server.pool(request)
        assert got.usage.cached_tokens == got.usage.prompt_tokens
        assert_same(outputs(got), outputs(server.pool(request, bypass=True)))


def test_a_request_of_64_texts_with_40_seen_computes_24(server: Cached) -> None:
    seen = [f"seen text number {k}" for k in range(40)]
    server.pool(pb.PoolRequest(model="minilm", embed=pb.TextInput(texts=seen)))
    texts = [*seen, *(f"unseen text number {k}" for k in range(24))]
    before = settled(server)
    got = server.pool(pb.PoolRequest(model="minilm", embed=pb.TextInput(texts=texts)))
    assert growth(server, before, "pooling_cache_misses_total", 24) == 24
    assert 0 < got.usage.cached_tokens < got.usage.prompt_tokens
    want = server.pool(pb.PoolRequest(model="minilm", embed=pb.TextInput(texts=texts)), bypass=True)
    assert_same(outputs(got), outputs(want))


def test_fifty_identical_calls_at_once_make_one_forward_pass(server: Cached) -> None:
    request = pb.PoolRequest(model="minilm", embed=pb.TextInput(texts=["all at once, once"]))
    before = settled(server)
    with ThreadPoolExecutor(50) as pool:
        answers = list(pool.map(lambda _: server.pool(request), range(50)))
    assert growth(server, before, "pooling_cache_hits_total", 49) == 49
    assert growth(server, before, "pooling_cache_misses_total", 1) == 1
    assert sum(a.usage.cached_tokens == 0 for a in answers) == 1
    for answer in answers[1:]:
        assert_same(outputs(answer), outputs(answers[0]))


def test_one_keys_entries_are_not_served_to_another(server: Cached) -> None:
    request = pb.PoolRequest(model="minilm", embed=pb.TextInput(texts=["a tenant's secret"]))
    assert server.pool(request, KEY_A).usage.cached_tokens == 0
    assert server.pool(request, KEY_A).usage.cached_tokens > 0
    assert server.pool(request, KEY_B).usage.cached_tokens == 0  # B's own entry now
    assert server.pool(request, KEY_B).usage.cached_tokens > 0


def _http_embed(
    server: Cached, text: str, *headers: tuple[str, str], **fields: object
) -> dict[str, object]:
    body = json.dumps({"model": "minilm", "input": [text], **fields}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{server.http_port}/v1/embeddings", body, method="POST"
    )
    request.add_header("Content-Type", "application/json")
    request.add_header("Authorization", f"Bearer {KEY_A}")
    for name, value in headers:
        request.add_header(name, value)
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def test_usage_and_the_http_bypass(server: Cached) -> None:
    text = "cached over HTTP"
    first = _http_embed(server, text)
    assert "prompt_tokens_details" not in first["usage"]  # type: ignore[operator]
    second = _http_embed(server, text)
    usage = second["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": usage["prompt_tokens"]}  # type: ignore[index]
    for directive in ("no-cache", "no-store", "max-age=0, no-store"):
        bypassed = _http_embed(server, text, ("Cache-Control", directive))
        assert "prompt_tokens_details" not in bypassed["usage"]  # type: ignore[operator]
    assert "prompt_tokens_details" not in _http_embed(server, text, bypass_cache=True)["usage"]  # type: ignore[operator]
    # Bypassed calls neither read nor wrote: a new text bypassed once is still a miss.
    _http_embed(server, "never kept", ("Cache-Control", "no-store"))
    assert "prompt_tokens_details" not in _http_embed(server, "never kept")["usage"]  # type: ignore[operator]


def test_metrics_show_the_cache(server: Cached) -> None:
    server.pool(pb.PoolRequest(model="minilm", embed=pb.TextInput(texts=["for the metrics"])))
    samples = scrape(server.metrics_port)
    assert metric_sum(samples, "pooling_cache_bytes") > 0
    assert metric_sum(samples, "pooling_cache_entries") > 0
    assert metric_sum(samples, "pooling_cache_misses_total") > 0
    assert metric_sum(samples, "pooling_cache_hits_total", tier="memory") > 0
    for name in ("pooling_cache_evictions_total", "pooling_cache_redis_errors_total"):
        assert name in samples
