"""LoRA adapters per request (service/adapters.py, engine/models/adapters.py), on one real
server: a split server of one front end and one engine (the default layout on a host
without a GPU, so the adapter travels over the IPC link), serving a random-weight BERT with
two random LoRA adapters given at start (--adapter), and beside it the same BERT with each
adapter merged by PEFT's merge_and_unload(), which the adapters' answers must equal.
"""

from __future__ import annotations

import random
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
import urllib3

from pooling_client import PoolingClient, PoolingError, PoolingParams
from tests.fixture_models import merged_lora, tiny_lora, tiny_mean_bert
from tests.server_process import ServerProcess, spawn_server
from tests.service.test_model_repository import http_port

ADMIN, API = "admin-secret", "api-secret"
# Texts of several lengths, so that batches pad and the tokens an adapter changes vary.
TEXTS = [
    "a",
    "adapters share one base model",
    "each request picks its adapter by name, and batches form per adapter",
    "the merged model is the reference: the side path must equal it to rounding " * 3,
]
MIN_COSINE = 0.9999


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The base, three adapters (two at start, one loaded at run time) and each merged."""
    root = tmp_path_factory.mktemp("lora")
    base = tiny_mean_bert(root / "base")
    targets = {
        "a1": ("query", "value"),
        "a2": ("query", "key", "value", "dense"),
        "a3": ("value", "dense"),
    }
    found = {"base": base}
    for seed, (name, layers) in enumerate(targets.items(), start=1):
        found[name] = tiny_lora(root / name, base, seed, layers)
        found[f"merged-{name}"] = merged_lora(root / f"merged-{name}", base, found[name])
    return found


@pytest.fixture(scope="module")
def server(
    folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    args = ["--dtype", "float32", "--api-key", API, "--admin-key", ADMIN, "--http-port", "0"]
    args += ["--frontends", "1", "--model", f"base={folders['base']}"]
    args += ["--adapter", f"a1={folders['a1']}", "--adapter", f"a2={folders['a2']}"]
    for name in ("a1", "a2", "a3"):  # served as plain models: the references
        args += ["--model", f"merged-{name}={folders[f'merged-{name}']}"]
    args += ["--backend", "torch"]  # the references as the adapters' base runs: on torch
    process = spawn_server(args, tmp_path_factory.mktemp("logs"), "adapters")
    try:
        process.wait_serving(400.0)
        yield process
    finally:
        process.stop(signal.SIGTERM, timeout=30)


def client(server: ServerProcess, **keys: str) -> PoolingClient:
    return PoolingClient(server.address, timeout=120, api_key=API, **keys)


def embed(pooling: PoolingClient, model: str, adapter: str | None = None) -> np.ndarray:
    params = PoolingParams(adapter=adapter)
    return pooling.embed(TEXTS, model=model, pooling_params=params, output="numpy")  # type: ignore[return-value]


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def test_adapters_at_start_listed_with_their_model(server: ServerProcess) -> None:
    with client(server) as pooling:
        listed = {model.name: model for model in pooling.list_models()}
    assert listed["a1"].parent == listed["a2"].parent == "base"
    assert listed["a1"].state == "loaded" and listed["base"].parent == ""
    # An adapter's own matrices, far less than the base weights it shares.
    assert 0 < listed["a1"].memory_bytes < listed["base"].memory_bytes / 10
    assert listed["a1"].info is not None and listed["a1"].info.tasks == listed["base"].info.tasks  # type: ignore[union-attr]
    url = f"http://127.0.0.1:{http_port(server)}/v1/models"
    answer = urllib3.request("GET", url, headers={"Authorization": f"Bearer {API}"})
    models = {model["id"]: model for model in answer.json()["data"]}
    assert models["a2"]["parent"] == "base" and "parent" not in models["base"]


def test_mixed_traffic_equals_merged_models(server: ServerProcess) -> None:
    """The base and two adapters, each picked by model name or by params.adapter, called
    at once from several threads: every answer equals its merged model's."""
    with client(server) as pooling:
        reference = {name: embed(pooling, name) for name in ("base", "merged-a1", "merged-a2")}
        for name in ("merged-a1", "merged-a2"):  # the adapters change every vector
            assert cosines(reference[name], reference["base"]).max() < 0.999
        calls = [
            ("a1", None, "merged-a1"),
            ("base", "a1", "merged-a1"),
            ("a2", None, "merged-a2"),
            ("", "a2", "merged-a2"),  # the default model, by params.adapter
            ("base", None, "base"),
        ] * 8
        random.Random(0).shuffle(calls)
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda call: embed(pooling, call[0], call[1]), calls))
    for (model, adapter, expected), answer in zip(calls, answers, strict=True):
        found = cosines(answer, reference[expected])
        assert found.min() >= MIN_COSINE, (model, adapter, expected, found)


def test_unknown_adapter_refused_by_name(server: ServerProcess) -> None:
    with client(server) as pooling:
        with pytest.raises(PoolingError) as refused:
            embed(pooling, "base", "no-such-adapter")
        assert refused.value.code == grpc.StatusCode.NOT_FOUND
        assert refused.value.reason == "ADAPTER_NOT_FOUND"
        assert '"no-such-adapter"' in str(refused.value) and '"a1"' in str(refused.value)
        with pytest.raises(PoolingError) as elsewhere:  # an adapter of another model
            embed(pooling, "merged-a1", "a1")
        assert elsewhere.value.reason == "ADAPTER_NOT_FOUND"
    url = f"http://127.0.0.1:{http_port(server)}/v1/embeddings"
    body = {"model": "base", "adapter": "no-such-adapter", "input": ["x"]}
    answer = urllib3.request("POST", url, json=body, headers={"Authorization": f"Bearer {API}"})
    assert answer.status == 404
    assert answer.json()["error"]["code"] == "ADAPTER_NOT_FOUND"


def test_load_and_unload_at_run_time(server: ServerProcess, folders: dict[str, Path]) -> None:
    """vLLM's routes with the admin key (the API key refused), then gRPC's repository."""
    url = f"http://127.0.0.1:{http_port(server)}/v1/load_lora_adapter"
    body = {"lora_name": "a3", "lora_path": str(folders["a3"]), "model": "base"}
    refused = urllib3.request("POST", url, json=body, headers={"Authorization": f"Bearer {API}"})
    assert refused.status == 401
    loaded = urllib3.request("POST", url, json=body, headers={"Authorization": f"Bearer {ADMIN}"})
    assert loaded.status == 200, loaded.data
    with client(server) as pooling:
        reference = embed(pooling, "merged-a3")
        assert cosines(embed(pooling, "a3"), reference).min() >= MIN_COSINE
        assert cosines(embed(pooling, "base", "a3"), reference).min() >= MIN_COSINE
    unload = url.replace("load_lora", "unload_lora")
    answer = urllib3.request(
        "POST", unload, json={"lora_name": "a3"}, headers={"Authorization": f"Bearer {ADMIN}"}
    )
    assert answer.status == 200, answer.data
    with client(server) as pooling:
        with pytest.raises(PoolingError) as gone:
            embed(pooling, "base", "a3")
        assert gone.value.reason == "ADAPTER_NOT_FOUND"
    # The same adapter again through ModelRepositoryService, under another name.
    with client(server, admin_key=ADMIN) as admin:
        entry = admin.load_adapter("a3-again", str(folders["a3"]), model="base")
        assert entry.state == "loaded" and entry.parent == "base" and entry.memory_bytes > 0
        assert cosines(embed(admin, "a3-again"), reference).min() >= MIN_COSINE
        admin.unload_model("a3-again")
        with pytest.raises(PoolingError) as unknown:
            admin.unload_model("a3-again")
        assert unknown.value.reason in ("ADAPTER_NOT_FOUND", "MODEL_NOT_LOADED")
        with pytest.raises(PoolingError) as broken:
            admin.load_adapter("broken", str(folders["base"]), model="base")
        assert broken.value.reason == "ADAPTER_LOAD_FAILED"
        assert "adapter_config.json" in str(broken.value)
    with client(server) as pooling:
        assert "a1" in {model.name for model in pooling.list_models()}
