"""LoRA adapters in the engine (engine/models/adapters.py), in one process: the batching
queue mixes adapters in a batch, and the engine's answers for mixed concurrent requests,
each row through its own adapter, equal PEFT's merged models' (the one-process path a server with
--frontends 0 runs; tests/service/test_adapters.py runs the split server's).
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from pooling_server.engine.inputs.tokenization import TokenSequence
from pooling_server.engine.models.loader import load_adapter, load_model
from pooling_server.engine.models.model_runner import LoadedModel
from pooling_server.engine.models.model_spec import ModelSpec
from pooling_server.engine.requests.outputs import Embedding
from pooling_server.engine.requests.params import Task
from pooling_server.engine.requests.request import PoolRequest
from pooling_server.engine.scheduling.batch_queue import BatchConfig, BatchQueue
from pooling_server.engine.scheduling.engine import Engine
from pooling_server.engine.scheduling.jobs import Job
from tests.fixture_models import merged_lora, tiny_lora, tiny_mean_bert

TEXTS = ["one", "two words", "a sentence of several words", "short", "a longer text " * 4]


def test_a_batch_mixes_adapters() -> None:
    """Jobs of three adapters and the base, of like lengths, queued together: batches are
    formed by length alone, so one batch takes items of several adapters (each row then
    runs through its own), and every item is taken once."""
    runner = types.SimpleNamespace(info=types.SimpleNamespace(name="m"), adapters=object())
    queue = BatchQueue(runner, BatchConfig(max_batch_size=64))  # type: ignore[arg-type]
    rng = random.Random(0)
    adapters = [None, "a", "b", "c"]
    loop = asyncio.new_event_loop()
    try:
        for key in range(80):
            work = [(TokenSequence(list(range(rng.randint(8, 10))), None, [], []), False)]
            job = Job(work, list, loop.create_future(), client=f"c{key % 5}", key=key)
            job.adapter = adapters[key % 4]
            assert not queue.enqueue([job])
    finally:
        loop.close()
    taken, mixes = [], []
    while batch := queue._take_batch():
        mixes.append(len({item.job.adapter for item in batch}))
        taken += [item.job.key for item in batch]
    assert sorted(taken) == list(range(80))
    assert max(mixes) == 4, mixes


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of the base model ("base") and its adapters."""
    return tmp_path_factory.mktemp("lora")


@pytest.fixture(scope="module")
def models(root: Path) -> dict[str, LoadedModel]:
    """The base with two adapters, and each adapter merged into a model of its own."""
    base = tiny_mean_bert(root / "base")
    a1 = tiny_lora(root / "a1", base, 1, ("query", "value"))
    a2 = tiny_lora(root / "a2", base, 2, ("key", "dense"))

    def load(spec: ModelSpec) -> LoadedModel:
        return load_model(spec, device=torch.device("cpu"), dtype=torch.float32)

    adapters = (("a1", str(a1)), ("a2", str(a2)))
    return {
        "base": load(ModelSpec(str(base), "base", adapters=adapters)),
        "m1": load(ModelSpec(str(merged_lora(root / "m1", base, a1)), "m1")),
        "m2": load(ModelSpec(str(merged_lora(root / "m2", base, a2)), "m2")),
    }


def test_mixed_requests_equal_the_merged_models(models: dict[str, LoadedModel]) -> None:
    calls = [("a1", None, "m1"), ("base", "a2", "m2"), ("base", None, "base")] * 6
    random.Random(1).shuffle(calls)
    seen: list[set[str | None]] = []
    runner = models["base"].runner
    forward = runner.forward

    def recorded(batch, keep, alone=True, adapters=()):  # type: ignore[no-untyped-def]
        seen.append(set(adapters))
        return forward(batch, keep, alone, adapters)

    runner.forward = recorded  # type: ignore[method-assign]

    async def run() -> tuple[dict[str, np.ndarray], list[np.ndarray]]:
        engine = Engine(list(models.values()), batch_config=BatchConfig(workers=2))
        await engine.start()
        try:

            async def embed(model: str, adapter: str | None = None) -> np.ndarray:
                request = PoolRequest(Task.EMBED, model=model, texts=tuple(TEXTS), adapter=adapter)
                result = await engine.pool(request)
                outputs = [o for o in result.outputs if isinstance(o, Embedding)]
                return np.stack([np.asarray(o.values, dtype=np.float32) for o in outputs])

            expected = {name: await embed(name) for name in ("base", "m1", "m2")}
            answers = await asyncio.gather(*(embed(m, a) for m, a, _ in calls))
            return expected, list(answers)
        finally:
            await engine.stop()

    expected, answers = asyncio.run(run())
    assert max(map(len, seen)) > 1, seen  # a pass mixed adapters
    assert {"a1", "a2", None} <= set().union(*seen)
    for name in ("m1", "m2"):
        assert _cosines(expected[name], expected["base"]).max() < 0.999  # the test can fail
    for (model, adapter, reference), answer in zip(calls, answers, strict=True):
        found = _cosines(answer, expected[reference])
        assert found.min() >= 0.9999, (model, adapter, found)


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def test_base_models_without_adapters_take_no_turn(models: dict[str, LoadedModel]) -> None:
    """A model given no adapter has none on its runner: its queue reads no adapter."""
    assert models["m1"].runner.adapters is None and models["m1"].info.adapters == ()
    assert models["base"].info.adapters == ("a1", "a2")


def test_loads_wait_for_passes(models: dict[str, LoadedModel], root: Path) -> None:
    """A third adapter loaded and unloaded over and over while two threads run mixed passes
    of the others: no pass runs while the layers change, every pass answers as before
    (rows do not mix), and the other adapters are left as they were."""
    runner = models["base"].runner
    adapters = runner.adapters
    assert adapters is not None
    extra = tiny_lora(root / "a3", root / "base", 3, ("query", "dense"))
    rows = [TokenSequence(list(range(1, n)), None, [], []) for n in (5, 7, 9, 6)]
    names = ["a1", None, "a2", "a1"]
    keep = [False] * len(rows)
    expected = runner.forward(rows, keep, True, names)
    for row, name, want in zip(rows, names, expected, strict=True):
        alone = runner.forward([row], [False], True, [name])[0]
        np.testing.assert_allclose(alone, want, rtol=1e-4, atol=1e-5)
    spans: dict[str, list[tuple[float, float]]] = {"pass": [], "change": []}

    def timed(kind: str, call):  # type: ignore[no-untyped-def]
        def run(*args, **kwargs):  # type: ignore[no-untyped-def]
            began = time.monotonic()
            try:
                return call(*args, **kwargs)
            finally:
                spans[kind].append((began, time.monotonic()))

        return run

    stop = threading.Event()

    def passes() -> int:
        done = 0
        while not stop.is_set():
            found = runner.forward(rows, keep, False, names)
            for row, want in zip(found, expected, strict=True):
                np.testing.assert_allclose(row, want, rtol=1e-4, atol=1e-5)
            done += 1
        return done

    peft = adapters._peft
    runner._forward = timed("pass", runner._forward)  # type: ignore[method-assign]
    peft.load_adapter = timed("change", peft.load_adapter)
    peft.delete_adapter = timed("change", peft.delete_adapter)
    try:
        with ThreadPoolExecutor(2) as pool:
            running = [pool.submit(passes) for _ in range(2)]
            try:
                for _ in range(5):
                    assert load_adapter(runner, "a3", str(extra)) > 0
                    adapters.unload("a3")
            finally:
                stop.set()
            assert all(future.result() > 0 for future in running)
    finally:
        del runner._forward, peft.load_adapter, peft.delete_adapter
    assert len(spans["change"]) == 10
    for a, b in spans["change"]:
        overlapping = [(c, d) for c, d in spans["pass"] if c < b and a < d]
        assert not overlapping, (a, b, overlapping)
    assert sorted(adapters.paths) == ["a1", "a2"]


def test_one_name_loaded_at_once_twice_loads_once(
    models: dict[str, LoadedModel], root: Path
) -> None:
    """Two front ends' loads of one adapter name at the same moment (as a split server's
    engine sees them): both answer with its size, its layers are injected once, and a
    load of that name from another folder is refused until it is unloaded."""
    runner = models["base"].runner
    adapters = runner.adapters
    assert adapters is not None
    folder = tiny_lora(root / "a4", root / "base", 4, ("value",))
    other = tiny_lora(root / "a5", root / "base", 5, ("value",))
    injected = []
    load = adapters._peft.load_adapter

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        injected.append(args)
        return load(*args, **kwargs)

    adapters._peft.load_adapter = counted
    try:
        with ThreadPoolExecutor(2) as pool:
            sizes = list(pool.map(lambda _: load_adapter(runner, "a4", str(folder)), range(2)))
        assert sizes[0] == sizes[1] > 0 and len(injected) == 1
        with pytest.raises(ValueError, match="already loaded from"):
            load_adapter(runner, "a4", str(other))
    finally:
        del adapters._peft.load_adapter
        adapters.unload("a4")
    assert sorted(adapters.paths) == ["a1", "a2"]
