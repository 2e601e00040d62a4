"""Eviction under --model-memory-gb, on a real one-process server.

The budget (10 MB) holds the pinned --model (a 4 MB random-weight classifier) and one of
the repository's two 4 MB models, never both: a call naming the other loads it in place
of the least recently used, whose next call loads it back, answering as before. No
--max-loaded-models is given, so only the memory budget evicts.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from pooling_client import PoolingClient
from tests.conftest import Served, server_args
from tests.server_process import ServerProcess, running_server

TEXTS = ["a memory budget", "fits one model of the two"]


@pytest.fixture(scope="module")
def budgeted(
    served: dict[str, Served],
    model_folders: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ServerProcess]:
    repository = tmp_path_factory.mktemp("budget-models")
    for name, folder in (("mem-a", "tiny-st-mean"), ("mem-b", "tiny-bert")):
        (repository / name).symlink_to(model_folders[folder], target_is_directory=True)
    args = [*server_args([served["tiny-classifier"]]), "--dtype", "float32"]
    args += ["--backend", "torch", "--frontends", "0", "--model-repository", str(repository)]
    args += ["--model-memory-gb", "0.010"]
    yield from running_server(args, tmp_path_factory.mktemp("budget-logs"), "budget")


def embed(server: ServerProcess, model: str) -> np.ndarray:
    with PoolingClient(server.address, timeout=120) as client:
        return np.stack([o.outputs.embedding for o in client.embed(TEXTS, model=model)])


def states(server: ServerProcess) -> dict[str, tuple[str, int]]:
    with PoolingClient(server.address, timeout=120) as client:
        return {m.name: (m.state, m.memory_bytes) for m in client.list_models()}


def test_a_budget_for_one_of_two_evicts_the_least_recently_used(budgeted: ServerProcess) -> None:
    first_a = embed(budgeted, "mem-a")
    listed = states(budgeted)
    assert listed["mem-a"][0] == "loaded" and listed["mem-b"][0] == "available", listed
    assert 3_000_000 < listed["mem-a"][1] < 6_000_000  # what the budget is counted in

    first_b = embed(budgeted, "mem-b")  # no room for both: mem-a goes
    listed = states(budgeted)
    assert listed["mem-a"][0] == "available" and listed["mem-b"][0] == "loaded", listed
    assert listed["tiny-classifier"][0] == "loaded"  # pinned: never evicted
    assert budgeted.log().count("evicting model mem-a (least recently used) for mem-b") == 1

    np.testing.assert_array_equal(embed(budgeted, "mem-a"), first_a)  # loaded back
    listed = states(budgeted)
    assert listed["mem-a"][0] == "loaded" and listed["mem-b"][0] == "available", listed
    assert budgeted.log().count("evicting model mem-b (least recently used) for mem-a") == 1
    np.testing.assert_array_equal(embed(budgeted, "mem-b"), first_b)
    assert budgeted.log().count("evicting model mem-a") == 2
