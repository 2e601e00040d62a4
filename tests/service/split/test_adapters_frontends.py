"""LoRA adapters loaded at run time on a server of two front ends over two engines.

An adapter loaded through one front end is loaded on both engines, which tell the other
front end (engine/scheduling/core.py's ModelChanged naming its base model): called by name
through either front end it answers as PEFT's merged model does; unloaded through one
while calls arrive through the other, no call is lost, and then both refuse it. Each client
is pinned to a front end as test_repository_frontends pins them (its `pinned` fixture,
over this module's `f2`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pooling_client import PoolingClient, PoolingError
from tests.fixture_models import merged_lora, tiny_lora, tiny_mean_bert
from tests.service.split.test_frontends import Split, start_split, stop_split, wait_for
from tests.service.split.test_repository_frontends import (  # noqa: F401 (a fixture)
    ADMIN,
    pinned,
    served_through,
    state_of,
)
from tests.service.test_adapters import MIN_COSINE, cosines, embed


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The base, one adapter (loaded at run time) and the base with it merged."""
    root = tmp_path_factory.mktemp("f2-lora")
    base = tiny_mean_bert(root / "base")
    adapter = tiny_lora(root / "lora", base, 7, ("query", "value", "dense"))
    return {"base": base, "lora": adapter, "merged": merged_lora(root / "merged", base, adapter)}


@pytest.fixture(scope="module")
def f2(folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Split]:
    args = ["--model", f"base={folders['base']}", "--model", f"merged={folders['merged']}"]
    args += ["--dtype", "float32", "--backend", "torch", "--engines-per-device", "2"]
    args += ["--admin-key", ADMIN]
    split = start_split(args, tmp_path_factory.mktemp("f2-adapters"), "f2a", frontends=2)
    yield split
    stop_split(split)


def test_adapter_loaded_through_one_front_end_served_by_both_then_unloaded(
    f2: Split,
    pinned: list[PoolingClient],  # noqa: F811 (the imported fixture)
    folders: dict[str, Path],
) -> None:
    first, second = pinned
    reference = embed(first, "merged")
    assert cosines(reference, embed(first, "base")).max() < 0.999  # the adapter changes all
    for client in pinned:
        assert not served_through(client, "lora")

    loaded = first.load_adapter("lora", str(folders["lora"]), model="base")
    assert (loaded.state, loaded.parent) == ("loaded", "base")
    # The other front end routes it once both engines have told it of the load.
    assert wait_for(lambda: served_through(second, "lora"), 60), f2.server.log()[-3000:]
    for client in pinned:
        listed = {model.name: model for model in client.list_models()}
        assert (listed["lora"].state, listed["lora"].parent) == ("loaded", "base")

    calls = [(client, k) for k in range(8) for client in pinned]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda call: embed(call[0], "lora"), calls))
    for answer in answers:
        found = cosines(answer, reference)
        assert found.min() >= MIN_COSINE, found

    # Unloaded through the other front end while calls keep arriving through the first:
    # each is answered by the adapter or refused by name, none lost to its matrices going.
    stop, started = threading.Event(), threading.Barrier(3)

    def keep_calling() -> list[object]:
        outcomes: list[object] = [embed(first, "lora")]
        started.wait()
        while not stop.is_set():
            try:
                outcomes.append(embed(first, "lora"))
            except PoolingError as error:
                outcomes.append(error.reason)
        return outcomes

    with ThreadPoolExecutor(2) as pool:
        running = [pool.submit(keep_calling) for _ in range(2)]
        started.wait()
        try:
            assert second.unload_model("lora").state == "available"
        finally:
            stop.set()
        outcomes = [outcome for future in running for outcome in future.result()]
    for outcome in outcomes:
        if isinstance(outcome, str):
            assert outcome == "MODEL_NOT_FOUND", outcome
        else:
            assert cosines(outcome, reference).min() >= MIN_COSINE
    for client in pinned:
        assert not served_through(client, "lora")
        assert state_of(client, "lora") == "unknown"
    assert cosines(embed(second, "base"), reference).max() < 0.999  # the base is itself again
    assert "jobs for unknown model" not in f2.server.log()
