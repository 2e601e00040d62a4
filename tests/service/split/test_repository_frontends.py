"""Run-time loading with two front ends over two engines (--frontends 2).

A load or unload made through one front end reaches every engine, and the engines tell
the other front end (engine/scheduling/core.py's ModelChanged): a model loaded through
one is served through both, one unloaded through either is refused on both, and requests
for a repository model arriving through both front ends at once share one load per
engine. Each client is pinned to a front end by the connection it holds (`pinned`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import psutil
import pytest

from pooling_client import PoolingClient, PoolingError
from tests.conftest import Served, server_args
from tests.service.split.test_frontends import Split, start_split, stop_split, wait_for

ADMIN = "f2-admin"
TEXTS = ["two front ends", "one model loaded at run time"]
OWN = [("grpc.use_local_subchannel_pool", 1)]  # each client its own connection


@pytest.fixture(scope="module")
def repository(model_folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("f2-models")
    (folder / "st-demand").symlink_to(model_folders["tiny-st-mean"], target_is_directory=True)
    return folder


@pytest.fixture(scope="module")
def f2(
    served: dict[str, Served], repository: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Split]:
    args = [*server_args([served["tiny-classifier"]]), "--dtype", "float32"]
    args += ["--backend", "torch", "--engines-per-device", "2", "--admin-key", ADMIN]
    args += ["--model-repository", str(repository)]
    split = start_split(args, tmp_path_factory.mktemp("f2-repository"), "f2r", frontends=2)
    yield split
    stop_split(split)


@pytest.fixture
def pinned(f2: Split) -> Iterator[list[PoolingClient]]:
    """One client connected to each front end (index 0, 1): clients are opened until each
    front end holds one, the connection's front end read from its established sockets."""
    with ExitStack() as stack:
        chosen: dict[int, PoolingClient] = {}
        for _ in range(32):
            before = f2.frontend_sockets(psutil.CONN_ESTABLISHED)
            client = stack.enter_context(
                PoolingClient(f2.server.address, timeout=120, admin_key=ADMIN, options=OWN)
            )
            client.list_models()  # connects
            after = f2.frontend_sockets(psutil.CONN_ESTABLISHED)
            grew = [k for k, (a, b) in enumerate(zip(before, after, strict=True)) if b > a]
            if len(grew) == 1:
                chosen.setdefault(grew[0], client)
            if len(chosen) == 2:
                break
        assert len(chosen) == 2, "no connection reached some front end"
        yield [chosen[0], chosen[1]]


def loads_logged(split: Split, name: str) -> int:
    """Engine processes that logged loading `name` (each engine logs its own)."""
    return split.server.log().count(f"loaded model {name} (")


def embedded(client: PoolingClient, model: str) -> np.ndarray:
    return np.stack([o.outputs.embedding for o in client.embed(TEXTS, model=model)])


def served_through(client: PoolingClient, model: str) -> bool:
    try:
        client.embed(TEXTS, model=model)
    except PoolingError as error:
        assert error.reason == "MODEL_NOT_FOUND", error
        return False
    return True


def state_of(client: PoolingClient, name: str) -> str:
    return next((m.state for m in client.list_models() if m.name == name), "unknown")


def test_loaded_through_one_served_by_both_unloaded_through_the_other(
    f2: Split, pinned: list[PoolingClient], model_folders: dict[str, Path]
) -> None:
    first, second = pinned
    source = str(model_folders["tiny-st-mean"])
    assert not served_through(second, "st")
    assert first.load_model("st", source, options={"backend": "torch"}).state == "loaded"
    assert loads_logged(f2, "st") == 2, f2.server.log()[-3000:]
    # The other front end learns of it from both engines, and routes it once both have.
    assert wait_for(lambda: served_through(second, "st"), 60), f2.server.log()[-3000:]
    assert state_of(second, "st") == "loaded"
    np.testing.assert_array_equal(embedded(second, "st"), embedded(first, "st"))

    assert second.unload_model("st").state == "available"
    for client in pinned:
        assert not served_through(client, "st")
        assert state_of(client, "st") == "unknown"
    for _ in range(10):  # the start-up model serves on through both, from both engines
        for client in pinned:
            assert client.classify(TEXTS, model="tiny-classifier")
    assert "jobs for unknown model" not in f2.server.log()


def test_on_demand_through_both_front_ends_loads_once_per_engine(
    f2: Split, pinned: list[PoolingClient]
) -> None:
    assert loads_logged(f2, "st-demand") == 0
    answers: list[np.ndarray] = []
    failures: list[BaseException] = []

    def call(client: PoolingClient) -> None:
        try:
            answers.append(embedded(client, "st-demand"))
        except BaseException as error:  # reported below
            failures.append(error)

    threads = [threading.Thread(target=call, args=(c,)) for c in pinned for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    assert not failures, failures
    assert len(answers) == 8
    for answer in answers[1:]:
        np.testing.assert_array_equal(answer, answers[0])
    # Both front ends asked each engine; each engine loaded it once.
    assert loads_logged(f2, "st-demand") == 2, f2.server.log()[-3000:]
    for client in pinned:
        assert state_of(client, "st-demand") == "loaded"
