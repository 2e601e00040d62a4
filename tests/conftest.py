"""Session fixtures: fixture models on disk and one real server that serves them all."""

from __future__ import annotations

import json
import os
import signal
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from pooling_client import PoolingClient
from pooling_client.v1 import pooling_pb2_grpc
from tests.fixture_models import MINILM, build_all
from tests.server_process import ServerProcess, start_server

DEFAULT_MODEL = "sentence-transformers/all-MiniLM-L6-v2"

# Servers the suite starts run torch unless a test asks for a backend (--backend on the
# command line wins over the variable), and never write exports to the user's cache.
os.environ.setdefault("POOLING_BACKEND", "torch")
os.environ.setdefault(
    "POOLING_BACKEND_CACHE_DIR", tempfile.mkdtemp(prefix="pooling-backend-cache-")
)
MAX_CLIENT_BATCH_SIZE = 64

# The files that take longest (a minute or more on 2 cores), longest first. `make test`
# hands whole files to two workers as they free up (xdist --dist loadfile with
# --no-loadscope-reorder): starting with these, the two finish together instead of one
# running the soak alone at the end. Order only: a stale list costs time, never a result.
SLOWEST_FIRST = (
    "tests/reliability/test_soak.py",
    "tests/service/test_batch_job.py",
    "tests/service/test_ray_batch.py",
    "tests/service/test_ray_stage.py",
    "tests/reliability/test_drain_signals.py",
    "tests/engine/backends/test_backends.py",
    "tests/reliability/test_load.py",
    "tests/service/split/test_scale_out.py",
    "tests/service/test_backends_served.py",
    "tests/reliability/test_bad_input.py",
    "tests/service/split/test_frontends.py",
    "tests/reliability/test_faults.py",
    "tests/engine/test_task_parity.py",
    "tests/service/grpc/test_conformance.py",
    "tests/service/test_lifecycle.py",
    "tests/service/test_request_path.py",
)
QUIET_HOME = "tests/reliability/"  # `make test` runs `-m quiet` on this folder only


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))
    stray = [
        i.nodeid for i in items if "quiet" in i.keywords and not i.nodeid.startswith(QUIET_HOME)
    ]
    if stray:  # `make test` would run them in neither of its two passes
        raise pytest.UsageError(f"tests marked quiet outside {QUIET_HOME}: {stray}")


@dataclass(frozen=True)
class Served:
    """One --model of the shared server, with its per-model flags."""

    name: str
    folder: str
    pooling_type: str = "auto"
    truncation_side: str = "right"
    long_input: str = "reject"
    hf_overrides: dict[str, object] = field(default_factory=dict)


def served_models(folders: dict[str, Path]) -> list[Served]:
    minilm = str(MINILM)
    return [
        Served(DEFAULT_MODEL, DEFAULT_MODEL),
        Served("minilm-matryoshka", minilm, hf_overrides={"is_matryoshka": True}),
        Served("minilm-dims", minilm, hf_overrides={"matryoshka_dimensions": [128, 256]}),
        Served("tiny-bert", str(folders["tiny-bert"])),
        Served("tiny-bert-mean", str(folders["tiny-bert"]), pooling_type="mean"),
        Served("tiny-bert-left", str(folders["tiny-bert"]), truncation_side="left"),
        Served("tiny-bert-chunk", str(folders["tiny-bert"]), "mean", long_input="chunk"),
        Served("tiny-st-mean", str(folders["tiny-st-mean"])),
        Served("tiny-classifier", str(folders["tiny-classifier"])),
        Served("tiny-cross-encoder", str(folders["tiny-cross-encoder"])),
        Served("tiny-multilabel", str(folders["tiny-multilabel"])),
        Served("tiny-regression", str(folders["tiny-regression"])),
        Served("tiny-ner", str(folders["tiny-ner"])),
        Served("tiny-ner-chunk", str(folders["tiny-ner"]), long_input="chunk"),
        Served("tiny-decoder", str(folders["tiny-decoder"])),
    ]


def server_args(models: list[Served]) -> list[str]:
    args: list[str] = []
    for model in models:
        args += ["--model", f"{model.name}={model.folder}"]
    for model in models:
        args += ["--pooling-type", model.pooling_type]
        args += ["--truncation-side", model.truncation_side]
        args += ["--long-input", model.long_input]
        args += ["--hf-overrides", json.dumps(model.hf_overrides)]
    return args


@pytest.fixture(scope="session")
def model_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_all(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def served(model_folders: dict[str, Path]) -> dict[str, Served]:
    return {model.name: model for model in served_models(model_folders)}


@pytest.fixture(scope="session")
def server(
    served: dict[str, Served], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    args = server_args(list(served.values()))
    args += ["--max-client-batch-size", str(MAX_CLIENT_BATCH_SIZE), "--dtype", "float32"]
    process = start_server(args, tmp_path_factory.mktemp("logs"))
    yield process
    process.stop(signal.SIGTERM)


# A client and a stub per module, on whatever `server` the module sees: the shared one, or
# a module's own that overrides it (then these serve it as they are, without a copy).
@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[PoolingClient]:
    with PoolingClient(server.address, timeout=60) as pooling_client:
        yield pooling_client


@pytest.fixture(scope="module")
def stub(server: ServerProcess) -> Iterator[pooling_pb2_grpc.PoolingServiceStub]:
    """The raw generated stub, for requests the Python client would refuse to send."""
    with grpc.insecure_channel(server.address) as channel:
        yield pooling_pb2_grpc.PoolingServiceStub(channel)
