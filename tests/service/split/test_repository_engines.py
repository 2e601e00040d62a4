"""Run-time loading with --engines-per-device 2: every engine process loads its copy.

A real split server (one front end, two engines) with --admin-key: a Load answers once
both engines have loaded the model (each logs its load), calls spread over both, and an
Unload leaves no engine serving what the front end no longer routes to. A load that fails
names each engine that failed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from pooling_client import PoolingClient, PoolingError
from tests.conftest import Served, server_args
from tests.service.split.test_frontends import Split, start_split, stop_split

ADMIN = "k2-admin"
TEXTS = ["two engines", "one load call"]


@pytest.fixture(scope="module")
def k2(served: dict[str, Served], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Split]:
    args = [*server_args([served["tiny-classifier"]]), "--dtype", "float32"]
    args += ["--backend", "torch", "--engines-per-device", "2", "--admin-key", ADMIN]
    split = start_split(args, tmp_path_factory.mktemp("k2-repository"), "k2r", frontends=1)
    yield split
    stop_split(split)


def loads_logged(split: Split, name: str) -> int:
    """Engine processes that logged loading `name` (each engine logs its own)."""
    return split.server.log().count(f"loaded model {name} (")


def test_both_engines_load_serve_and_unload(k2: Split, model_folders: dict[str, Path]) -> None:
    server = k2.server
    assert len(k2.processes("engine")) == 2
    source = str(model_folders["tiny-st-mean"])
    with PoolingClient(server.address, timeout=120, admin_key=ADMIN) as client:
        loaded = client.load_model("st", source, options={"backend": "torch"})
        assert loaded.state == "loaded" and loaded.memory_bytes > 0
        assert loaded.info is not None and loaded.info.engines_per_device == 2
        assert loads_logged(k2, "st") == 2, server.log()[-3000:]
        # Calls go to the engine with fewer items outstanding: a burst reaches both.
        answers = [client.embed(TEXTS, model="st") for _ in range(20)]
        first = np.stack([o.outputs.embedding for o in answers[0]])
        for answer in answers[1:]:
            np.testing.assert_array_equal(np.stack([o.outputs.embedding for o in answer]), first)

        assert client.unload_model("st").state == "available"
        with pytest.raises(PoolingError) as refused:
            client.embed(TEXTS, model="st")
        assert refused.value.reason == "MODEL_NOT_FOUND"
        # The other model serves on from both engines: nothing was left half unloaded.
        for _ in range(10):
            assert client.classify(TEXTS, model="tiny-classifier")
        assert "jobs for unknown model" not in server.log()

        client.load_model("st", source, options={"backend": "torch"})
        assert loads_logged(k2, "st") == 4
        np.testing.assert_array_equal(
            np.stack([o.outputs.embedding for o in client.embed(TEXTS, model="st")]), first
        )


def test_a_failed_load_names_each_engine(k2: Split, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with PoolingClient(k2.server.address, timeout=120, admin_key=ADMIN) as client:
        with pytest.raises(PoolingError) as refused:
            client.load_model("broken", str(tmp_path))
        assert refused.value.reason == "MODEL_LOAD_FAILED"
        assert "engine 0:" in refused.value.message and "engine 1:" in refused.value.message
        (listed,) = [m for m in client.list_models() if m.name == "broken"]
        assert listed.state == "failed"
