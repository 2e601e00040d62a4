"""The backends through the real server: a split server (--frontends 1) serves each model
on torch, onnx and openvino side by side; every task's answers over gRPC and HTTP match
torch's, ListModels says what runs each model, and the exports land in --backend-cache-dir."""

from __future__ import annotations

import json
import signal
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from pooling_client import PoolingClient
from tests.fixture_models import tiny_mlm
from tests.server_process import ServerProcess, free_port, start_server

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "Ünïcödé façade: naïve café, Straße, 東京タワー 🙂",
    " ".join(["the powerhouse of the cell is the mitochondria"] * 5),
]
KINDS = ("torch", "onnx", "openvino")
# served base name -> (fixture folder, --pooling-type)
MODELS = {
    "st": ("tiny-st-mean", "auto"),
    "cross": ("tiny-cross-encoder", "auto"),
    "cls": ("tiny-classifier", "auto"),
    "ner": ("tiny-ner", "auto"),
    "mlm": ("tiny-mlm", "splade"),
}


def _cos(a: object, b: object) -> float:
    x, y = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y)))


@pytest.fixture(scope="module")
def backend_server(
    model_folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProcess, int, list[str]]]:
    root = tmp_path_factory.mktemp("served-backends")
    folders = {**model_folders, "tiny-mlm": tiny_mlm(root / "tiny-mlm")}
    args = ["--frontends", "1", "--backend-cache-dir", str(root / "cache")]
    args += ["--http-port", str(http := free_port())]
    for base, (folder, _pooling) in MODELS.items():
        for kind in KINDS:
            args += ["--model", f"{base}-{kind}={folders[folder]}"]
    for _base, (_folder, pooling) in MODELS.items():
        for kind in KINDS:
            args += ["--backend", kind, "--pooling-type", pooling]
    # 18 models, 12 of them exported and checked against torch at start: minutes on a
    # loaded 2-core machine.
    process = start_server([*args, "--dtype", "float32"], root, serving_timeout=480)
    yield process, http, args
    process.stop(signal.SIGTERM)


def test_list_models_says_what_runs_each_model(backend_server: tuple) -> None:
    process, _http, _args = backend_server
    with PoolingClient(process.address, timeout=60) as client:
        cards = {card.name: card for card in client.models()}
    for base in MODELS:
        assert cards[f"{base}-torch"].backend == "torch"
        assert cards[f"{base}-torch"].backend_file == ""
        for kind in ("onnx", "openvino"):
            card = cards[f"{base}-{kind}"]
            assert (card.backend, card.precision) == (kind, "float32")
            assert card.backend_file.endswith((".onnx", ".xml"))
    log = process.log()
    assert "forward on openvino float32, file" in log and "exported to onnx in" in log


@pytest.mark.parametrize("kind", ["onnx", "openvino"])
def test_every_task_over_grpc_matches_torch(backend_server: tuple, kind: str) -> None:
    process, _http, _args = backend_server
    with PoolingClient(process.address, timeout=120) as client:

        def both(call, base, *args, **kwargs):  # type: ignore[no-untyped-def]
            ref = call(*args, model=f"{base}-torch", **kwargs)
            got = call(*args, model=f"{base}-{kind}", **kwargs)
            assert len(ref) == len(got)
            return zip(got, ref, strict=True)

        for got, ref in both(client.embed, "st", TEXTS):
            assert _cos(got.outputs.embedding, ref.outputs.embedding) >= 0.9999
        for got, ref in both(client.encode, "st", TEXTS):
            assert _cos(got.outputs.data, ref.outputs.data) >= 0.9999
        for got, ref in both(client.score, "st", TEXTS[0], TEXTS[1:]):
            assert got.outputs.score == pytest.approx(ref.outputs.score, abs=1e-4)
        for got, ref in both(client.score, "cross", TEXTS[0], TEXTS[1:]):
            assert got.outputs.score == pytest.approx(ref.outputs.score, abs=1e-4)
        for got, ref in both(client.classify, "cls", TEXTS):
            np.testing.assert_allclose(got.outputs.probs, ref.outputs.probs, atol=1e-4)
            assert got.outputs.label == ref.outputs.label
        for got, ref in both(client.encode, "ner", TEXTS, pooling_task="token_classify"):
            np.testing.assert_allclose(got.outputs.data, ref.outputs.data, atol=1e-4)
        for got, ref in both(client.embed_sparse, "mlm", TEXTS):
            got_map = dict(zip(got.outputs.indices, got.outputs.values, strict=True))
            ref_map = dict(zip(ref.outputs.indices, ref.outputs.values, strict=True))
            top = sorted(ref_map, key=ref_map.get, reverse=True)[:20]  # type: ignore[arg-type]
            assert _cos([got_map.get(i, 0.0) for i in top], [ref_map[i] for i in top]) >= 0.9999


def _post(port: int, path: str, body: dict) -> dict:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(), method="POST"
    )
    request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


@pytest.mark.parametrize("kind", ["onnx", "openvino"])
def test_http_answers_match_torch(backend_server: tuple, kind: str) -> None:
    _process, http, _args = backend_server

    def embeddings(model: str) -> list[list[float]]:
        data = _post(http, "/v1/embeddings", {"model": model, "input": TEXTS})["data"]
        return [item["embedding"] for item in data]

    for got, ref in zip(embeddings(f"st-{kind}"), embeddings("st-torch"), strict=True):
        assert _cos(got, ref) >= 0.9999
    scores = {
        name: [
            r["relevance_score"]
            for r in sorted(
                _post(http, "/v1/rerank", {"model": name, "query": TEXTS[0], "documents": TEXTS})[
                    "results"
                ],
                key=lambda r: r["index"],
            )
        ]
        for name in (f"cross-{kind}", "cross-torch")
    }
    np.testing.assert_allclose(scores[f"cross-{kind}"], scores["cross-torch"], atol=1e-4)


def test_exports_land_in_the_backend_cache_dir(backend_server: tuple) -> None:
    """--backend-cache-dir reaches the engine process: one export per model and backend
    there, each with the key file beside it. That a second load reuses them, and that a
    changed model exports again, tests/engine/test_backends.py shows without a server."""
    process, _http, args = backend_server
    cache = Path(args[args.index("--backend-cache-dir") + 1])
    exports = sorted(p.parent.name.split("-")[0] for p in cache.glob("*/export.json"))
    assert exports == sorted(base for base in MODELS for _ in ("onnx", "openvino")), exports
    assert len(list(cache.glob("*/model.onnx"))) == len(MODELS)
    assert len(list(cache.glob("*/openvino_model.xml"))) == len(MODELS)
    assert process.log().count("exported to") == 2 * len(MODELS)
