"""Models managed at run time (service/repository.py), on real servers.

`managed` is a split server (one front end, one engine: loads go over the IPC link) with
the shipped MiniLM pinned, a YAML repository of random-weight models and at most three
models loaded; `reference` runs in one process (--frontends 0), started with the model
the others load, to compare answers against; it takes an admin key too, so that loading
in one process is tested on it (under another name). Tests run in file order on the
module's servers.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
import urllib3

from pooling_client import PoolingClient, PoolingError
from pooling_client.v1 import pooling_pb2 as pb
from pooling_client.v1 import pooling_pb2_grpc
from tests.fixture_models import MINILM
from tests.metrics_endpoint import metric_sum, scrape
from tests.rpc_errors import decode_rpc_error
from tests.server_process import ServerProcess, free_port, spawn_server
from tests.service.split.test_frontends import Split, wait_for

ADMIN, API = "admin-secret", "api-secret"
TEXTS = ["a model loaded at run time", "answers as one started with it", "third text"]
REPOSITORY = ("rep-a", "rep-b", "rep-c")  # tiny-st-mean, tiny-bert, tiny-st-mean again
SERVING_TIMEOUT_S = 400.0


@pytest.fixture(scope="module")
def repository(model_folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A YAML repository: three good models (torch: no export on load) and a broken one."""
    root = tmp_path_factory.mktemp("repository")
    broken = root / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")  # no model_type: transformers refuses it
    sources = {
        "rep-a": model_folders["tiny-st-mean"],
        "rep-b": model_folders["tiny-bert"],
        "rep-c": model_folders["tiny-st-mean"],
        "broken": broken,
    }
    lines = []
    for name, folder in sources.items():
        lines += [f"{name}:", f"  source: {folder}", "  options:", "    backend: torch"]
    (root / "models.yaml").write_text("\n".join(lines) + "\n")
    return root / "models.yaml"


@pytest.fixture(scope="module")
def servers(
    repository: Path, model_folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, ServerProcess | Split]]:
    logs = tmp_path_factory.mktemp("logs")
    common = ["--dtype", "float32", "--backend", "torch", "--api-key", API]
    admin = ["--admin-key", ADMIN, "--model-repository", str(repository)]
    admin += ["--max-loaded-models", "3", "--failed-load-ttl-s", "600"]
    metrics_port = free_port()
    managed = spawn_server(
        [
            *common,
            *admin,
            "--model",
            f"minilm={MINILM}",
            "--frontends",
            "1",
            "--engine-stall-s",
            "0",
            "--metrics-port",
            str(metrics_port),
            "--http-port",
            "0",
        ],
        logs,
        "managed",
    )
    reference = spawn_server(
        [
            *common,
            "--model",
            f"st={model_folders['tiny-st-mean']}",
            "--frontends",
            "0",
            "--admin-key",
            ADMIN,
        ],
        logs,
        "reference",
    )
    try:
        for server in (managed, reference):  # two start-ups side by side on a busy host
            server.wait_serving(SERVING_TIMEOUT_S)
        yield {"managed": Split(managed, metrics_port), "reference": reference}
    finally:
        for server in (managed, reference):
            server.stop(signal.SIGTERM, timeout=30)


def client(server: ServerProcess, **keys: str) -> PoolingClient:
    return PoolingClient(server.address, timeout=120, api_key=API, **keys)


def embed(server: ServerProcess, model: str, texts: list[str] = TEXTS) -> np.ndarray:
    with client(server) as pooling:
        return np.stack([o.outputs.embedding for o in pooling.embed(texts, model=model)])


def states(server: ServerProcess) -> dict[str, str]:
    with client(server) as pooling:
        return {model.name: model.state for model in pooling.list_models()}


def refused_reason(server: ServerProcess, model: str) -> str:
    with pytest.raises(PoolingError) as refused:
        embed(server, model)
    return refused.value.reason


def in_flight_on(server: ServerProcess, model: str) -> int:
    """Calls in flight on `model`, as the repository's List (the admin's) counts them."""
    with grpc.insecure_channel(server.address) as channel:
        stub = pooling_pb2_grpc.ModelRepositoryServiceStub(channel)
        listed = stub.List(pb.ListRequest(), metadata=(("authorization", f"Bearer {ADMIN}"),))
    return next(m.in_flight for m in listed.models if m.name == model)


def http_port(server: ServerProcess) -> int:
    """The HTTP port the server chose (--http-port 0), from its log."""
    for line in server.log().splitlines():
        if "HTTP API on http://" in line:
            return int(line.rsplit(":", 1)[1])
    raise AssertionError(server.log())


def test_admin_key_required(servers: dict) -> None:
    managed: ServerProcess = servers["managed"].server
    channel = grpc.insecure_channel(managed.address)
    stub = pooling_pb2_grpc.ModelRepositoryServiceStub(channel)
    for metadata in ((), (("authorization", f"Bearer {API}"),)):
        with pytest.raises(grpc.RpcError) as refused:
            stub.List(pb.ListRequest(), metadata=metadata, timeout=30)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert decode_rpc_error(refused.value).reason == "ADMIN_KEY_REQUIRED"
    listed = stub.List(pb.ListRequest(), metadata=(("authorization", f"Bearer {ADMIN}"),))
    assert {m.name for m in listed.models} >= {"minilm", *REPOSITORY, "broken"}
    # The admin key does not open PoolingService, nor the API key the repository.
    admin_only = PoolingClient(managed.address, timeout=30, api_key=ADMIN)
    with pytest.raises(PoolingError) as refused_api, admin_only:
        admin_only.embed(TEXTS, model="minilm")
    assert refused_api.value.code == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(PoolingError) as refused_load, client(managed) as api_only:
        api_only.load_model("rep-b")
    assert refused_load.value.code == grpc.StatusCode.UNAUTHENTICATED
    channel.close()

    http = urllib3.PoolManager()
    url = f"http://127.0.0.1:{http_port(managed)}/v2/repository/index"
    assert http.request("POST", url, headers={"Authorization": f"Bearer {API}"}).status == 401
    answer = http.request("POST", url, headers={"Authorization": f"Bearer {ADMIN}"})
    assert answer.status == 200, answer.data
    assert {m["name"]: m["state"] for m in answer.json()}["rep-a"] == "available"


@pytest.mark.parametrize(("kind", "name"), [("managed", "st"), ("reference", "st-again")])
def test_load_serve_unload_reload(
    servers: dict, model_folders: dict[str, Path], kind: str, name: str
) -> None:
    """Split (over the IPC link) and in one process: answers equal the started model's."""
    server = servers[kind].server if kind == "managed" else servers[kind]
    expected = embed(servers["reference"], "st")
    source = str(model_folders["tiny-st-mean"])
    with client(server, admin_key=ADMIN) as admin:
        loaded = admin.load_model(name, source, options={"backend": "torch"})
        assert loaded.state == "loaded" and loaded.memory_bytes > 0
        assert loaded.info is not None and loaded.info.name == name
        np.testing.assert_allclose(embed(server, name), expected, rtol=1e-5, atol=1e-6)
        listed = {m.name: m for m in admin.list_models()}
        assert listed[name].state == "loaded" and listed[name].memory_bytes > 0
        assert admin.unload_model(name).state == "available"
        # Loaded by an admin, not from the repository: once unloaded it is gone.
        assert refused_reason(server, name) == "MODEL_NOT_FOUND"
        assert name not in states(server)
        admin.load_model(name, source, options={"backend": "torch"})
        np.testing.assert_allclose(embed(server, name), expected, rtol=1e-5, atol=1e-6)
        admin.unload_model(name)


def test_concurrent_first_requests_share_one_load(servers: dict) -> None:
    split: Split = servers["managed"]
    before = metric_sum(scrape(split.metrics_port), "pooling_model_loads_total", model="rep-a")
    assert states(split.server)["rep-a"] == "available"
    with ThreadPoolExecutor(50) as pool:
        answers = list(pool.map(lambda _: embed(split.server, "rep-a"), range(50)))
    for answer in answers[1:]:
        np.testing.assert_array_equal(answer, answers[0])
    loads = metric_sum(scrape(split.metrics_port), "pooling_model_loads_total", model="rep-a")
    assert loads - before == 1
    assert states(split.server)["rep-a"] == "loaded"


def test_lru_eviction_spares_calls_in_flight(servers: dict) -> None:
    """Three loaded at most: minilm (pinned) and two of rep-a, rep-b, rep-c."""
    split: Split = servers["managed"]
    server = split.server
    embed(server, "rep-a")
    embed(server, "rep-b")
    embed(server, "rep-a")  # rep-b is now the least recently used
    embed(server, "rep-c")  # evicts rep-b
    now = states(server)
    assert (now["rep-a"], now["rep-b"], now["rep-c"]) == ("loaded", "available", "loaded")
    evicted = metric_sum(split.scrape(), "pooling_model_evictions_total", model="rep-b")
    assert evicted >= 1

    # rep-a is the least recently used now, but a call on it is in flight: rep-c goes.
    embed(server, "rep-a")
    embed(server, "rep-c")
    (engine,) = split.processes("engine")
    os.kill(engine.pid, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(2) as pool:
            in_flight = pool.submit(embed, server, "rep-a")
            with client(server, admin_key=ADMIN) as admin:
                assert wait_for(lambda: in_flight_on(server, "rep-a") == 1, 30)
                loading = pool.submit(admin.load_model, "rep-b")
                assert wait_for(lambda: states(server)["rep-c"] == "unloading", 30)
                os.kill(engine.pid, signal.SIGCONT)
                assert loading.result(120).state == "loaded"
            assert in_flight.result(120).shape == (len(TEXTS), 32)
    finally:
        os.kill(engine.pid, signal.SIGCONT)
    now = states(server)
    assert (now["rep-a"], now["rep-b"], now["rep-c"]) == ("loaded", "loaded", "available")


def test_failed_load_is_remembered_and_refused_fast(servers: dict) -> None:
    split: Split = servers["managed"]
    assert refused_reason(split.server, "broken") == "MODEL_LOAD_FAILED"
    started = time.monotonic()
    for _ in range(20):
        assert refused_reason(split.server, "broken") == "MODEL_LOAD_FAILED"
    assert (time.monotonic() - started) / 20 < 0.5
    failed = metric_sum(
        split.scrape(), "pooling_model_loads_total", model="broken", outcome="failed"
    )
    assert failed == 1
    with client(split.server) as pooling:
        (broken,) = [m for m in pooling.list_models() if m.name == "broken"]
    assert broken.state == "failed" and "model_type" in broken.reason
    assert broken.retry_after_s > 500


def test_unload_under_load_loses_no_accepted_call(
    servers: dict, model_folders: dict[str, Path]
) -> None:
    server: ServerProcess = servers["managed"].server
    with client(server, admin_key=ADMIN) as admin:
        admin.load_model("victim", str(model_folders["tiny-bert"]), options={"backend": "torch"})
        outcomes: list[str] = []
        stop = threading.Event()

        def caller() -> None:
            with client(server) as pooling:
                while not stop.is_set():
                    try:
                        pooling.embed(TEXTS, model="victim")
                        outcomes.append("ok")
                    except PoolingError as error:
                        outcomes.append(error.reason or str(error.code))
                        if error.reason == "MODEL_NOT_FOUND":
                            return

        threads = [threading.Thread(target=caller) for _ in range(8)]
        for thread in threads:
            thread.start()
        assert wait_for(lambda: outcomes.count("ok") >= 40, 120)
        admin.unload_model("victim")
        stop.set()
        for thread in threads:
            thread.join(60)
    assert set(outcomes) <= {"ok", "MODEL_NOT_FOUND"}, set(outcomes)
    assert refused_reason(server, "victim") == "MODEL_NOT_FOUND"


def test_without_an_admin_key_no_repository_is_served(server: ServerProcess) -> None:
    """The shared server (no --admin-key): neither the service nor the routes exist."""
    with grpc.insecure_channel(server.address) as channel:
        stub = pooling_pb2_grpc.ModelRepositoryServiceStub(channel)
        with pytest.raises(grpc.RpcError) as absent:
            stub.List(pb.ListRequest(), metadata=(("authorization", f"Bearer {ADMIN}"),))
    assert absent.value.code() == grpc.StatusCode.UNIMPLEMENTED
