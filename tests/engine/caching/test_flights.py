"""Single-flight in the batching queue (engine/caching/flights.py), in process: an item
asked for while it is queued is computed once, and a flight whose owner goes away passes
to the call still waiting for it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest

from pooling_server.engine.caching.cache import CacheSettings
from pooling_server.engine.models.loader import LoadedModel
from pooling_server.engine.scheduling.engine import Engine
from tests.engine.test_batch_queue import (
    WAIT_S,
    ControlledRunner,
    _load,
    embed,
    ids_of,
    wait_until,
    with_runner,
)

pytestmark = pytest.mark.timeout(120)

T = TypeVar("T")


@pytest.fixture(scope="module")
def bert(model_folders: dict[str, Path]) -> LoadedModel:
    return _load(model_folders["tiny-bert"], "tiny-bert")


def run_cached(model: LoadedModel, body: Callable[[Engine], Awaitable[T]]) -> T:
    async def main() -> T:
        engine = Engine([model], cache=CacheSettings(memory_mb=8))
        await engine.start()
        try:
            return await asyncio.wait_for(body(engine), WAIT_S * 2)
        finally:
            if isinstance(model.runner, ControlledRunner):
                model.runner.open()
            await engine.stop()

    return asyncio.run(main())


def _computed(runner: ControlledRunner, ids: tuple[int, ...]) -> int:
    return sum(tuple(e.input_ids) == ids for batch in runner.batches for e in batch)


def test_a_queued_item_is_computed_once_for_every_call(bert: LoadedModel) -> None:
    model, runner = with_runner(bert, hold_first=True)
    [ids] = ids_of(bert, ["asked for three times"])

    async def body(engine: Engine) -> None:
        blocker = asyncio.ensure_future(engine.pool(embed("the blocking batch")))
        await runner.entered(1)
        calls = [
            asyncio.ensure_future(engine.pool(embed("asked for three times"))) for _ in range(3)
        ]
        flights = engine.queues["tiny-bert"].cache.flights  # type: ignore[union-attr]
        await wait_until(lambda: sum(map(len, flights.values())) == 2, "two calls to join")
        runner.open()
        await blocker
        results = await asyncio.gather(*calls)
        assert _computed(runner, ids) == 1
        assert sorted(r.cached_tokens for r in results) == [0, len(ids), len(ids)]
        for result in results[1:]:
            np.testing.assert_array_equal(result.outputs[0].values, results[0].outputs[0].values)
        again = await engine.pool(embed("asked for three times"))  # from memory now
        assert again.cached_tokens == len(ids) and _computed(runner, ids) == 1

    run_cached(model, body)


def test_a_flight_passes_to_a_waiter_when_its_owner_goes(bert: LoadedModel) -> None:
    model, runner = with_runner(bert, hold_first=True)
    [ids] = ids_of(bert, ["the owner will go away"])

    async def body(engine: Engine) -> None:
        blocker = asyncio.ensure_future(engine.pool(embed("the blocking batch")))
        await runner.entered(1)
        owner = asyncio.ensure_future(engine.pool(embed("the owner will go away")))
        flights = engine.queues["tiny-bert"].cache.flights  # type: ignore[union-attr]
        await wait_until(lambda: len(flights) == 1, "the owner to open the flight")
        waiter = asyncio.ensure_future(engine.pool(embed("the owner will go away")))
        await wait_until(lambda: sum(map(len, flights.values())) == 1, "the waiter to join")
        owner.cancel()
        with pytest.raises(asyncio.CancelledError):
            await owner
        runner.open()
        await blocker
        result = await waiter
        assert _computed(runner, ids) == 1
        assert result.cached_tokens == 0  # it computed the item itself, in the owner's place
        assert not flights

    run_cached(model, body)
