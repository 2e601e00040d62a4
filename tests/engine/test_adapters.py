"""LoRA adapters in the engine (engine/models/adapters.py), in one process: the batching
queue forms each batch of one adapter's items, and the engine's answers for mixed
concurrent requests equal PEFT's merged models' (the one-process path a server with
--frontends 0 runs; tests/service/test_adapters.py runs the split server's).
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from pooling_server.engine.inputs.tokenization import TokenSequence
from pooling_server.engine.models.adapters import AdapterSet
from pooling_server.engine.models.loader import load_model
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


def test_a_batch_holds_one_adapters_items() -> None:
    """Jobs of three adapters and the base, of like lengths, queued together: every batch
    taken holds one adapter's items (or the base's), and every item is taken once."""
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
    taken = []
    while batch := queue._take_batch():
        assert len({item.job.adapter for item in batch}) == 1, [i.job.adapter for i in batch]
        taken += [item.job.key for item in batch]
    assert sorted(taken) == list(range(80))


def test_passes_at_once_share_one_adapter() -> None:
    """Threads running passes of random adapters through one AdapterSet: passes that run
    at the same time always use the same adapter (a switch waits for the others), and
    every pass runs (no thread is left waiting)."""
    adapters = AdapterSet(torch.nn.Linear(1, 1), "m")
    adapters.paths = {"a": "", "b": ""}  # no PEFT layers: only the turns are under test
    running: list[str | None] = []
    mixed: list[list[str | None]] = []
    guard = threading.Lock()

    def passes(seed: int) -> int:
        rng = random.Random(seed)
        for _ in range(200):
            adapter = rng.choice([None, "a", "b"])
            with adapters.using(adapter):
                with guard:
                    running.append(adapter)
                    if len(set(running)) > 1:
                        mixed.append(list(running))
                time.sleep(0.0001 * rng.random())
                with guard:
                    running.remove(adapter)
        return 200

    with ThreadPoolExecutor(4) as pool:
        assert sum(pool.map(passes, range(4))) == 800
    assert not mixed, mixed[:3]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoadedModel]:
    """The base with two adapters, and each adapter merged into a model of its own."""
    root = tmp_path_factory.mktemp("lora")
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
    seen: list[str | None] = []
    runner = models["base"].runner
    forward = runner.forward

    def recorded(batch, keep, alone=True, adapter=None):  # type: ignore[no-untyped-def]
        seen.append(adapter)
        return forward(batch, keep, alone, adapter)

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
    assert {"a1", "a2", None} <= set(seen)
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
