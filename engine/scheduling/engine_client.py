"""Where a front end's jobs are computed: in this process, or in an engine process.

The engine (tokenizing, planning, heads) talks to one of these, as vLLM's front ends talk
to an EngineCoreClient. The local one owns the batching queues; the remote one
(engine/scheduling/remote_client.py) sends the jobs to engine processes and gets raw outputs back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from pooling_server.engine.caching.cache import CacheSettings, ResultCache
from pooling_server.engine.caching.flights import ModelCache
from pooling_server.engine.caching.key import model_identity
from pooling_server.engine.errors import PoolingError
from pooling_server.engine.scheduling.batch_queue import BatchConfig, BatchQueue
from pooling_server.engine.scheduling.jobs import Job

if TYPE_CHECKING:
    from pooling_server.engine.models.loader import LoadedModel


class EngineClient(Protocol):
    @property
    def queues(self) -> dict[str, BatchQueue]:
        """The batching queues held in this process, by model (none when remote)."""
        ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def submit(self, model: str, jobs: Sequence[Job]) -> list[tuple[Job, PoolingError]]:
        """Queue jobs for `model`, from any thread; returns the jobs refused at once.

        A job's future is resolved (on its event loop) with `job.finish(raws)`, or an error.
        """
        ...

    def cancel(self, job: Job) -> None:
        """Its caller went away: drop what is still queued. On the event loop's thread."""
        ...


class LocalEngineClient:
    """The models run in this process, each behind its own batching queue."""

    def __init__(
        self,
        models: Sequence[LoadedModel],
        config: BatchConfig,
        cache: CacheSettings | None = None,
    ) -> None:
        """`cache`: the result cache's settings; on, this process holds its tiers."""
        self._models = models
        self._config = config
        self._queues: dict[str, BatchQueue] = {}
        self.cache = ResultCache(cache) if cache is not None and cache.enabled else None

    def _cached(self, queue: BatchQueue, model: LoadedModel) -> BatchQueue:
        """The queue with the result cache on, keyed on the model's identity (its folder's
        files hashed once, engine/caching/key.py)."""
        if self.cache is not None:
            folder = getattr(model.runner, "folder", None)
            identity = model_identity(model.info, folder)
            queue.cache = ModelCache(self.cache, identity, model.runner)
        return queue

    @property
    def queues(self) -> dict[str, BatchQueue]:
        return self._queues

    async def start(self) -> None:
        for model in self._models:
            queue = self._cached(BatchQueue(model.runner, self._config), model)
            self._queues[model.info.name] = queue
            await queue.start()

    async def stop(self) -> None:
        await asyncio.gather(*(queue.stop() for queue in self._queues.values()))
        if self.cache is not None:
            self.cache.close()

    def submit(self, model: str, jobs: Sequence[Job]) -> list[tuple[Job, PoolingError]]:
        return self._queues[model].enqueue(jobs)

    async def add_model(self, model: LoadedModel) -> BatchQueue:
        """A model loaded at run time: its queue started (each worker warms it, off the
        loop) before anything routes to it."""
        queue = self._cached(BatchQueue(model.runner, self._config), model)
        await queue.start()
        self._queues[model.info.name] = queue
        self._models = [*self._models, model]
        return queue

    async def remove_model(self, name: str) -> None:
        """Its queue stopped and every reference to the model dropped, once nothing routes
        to it and its calls have finished (Engine.remove_model, ModelUse.drained)."""
        queue = self._queues.pop(name)
        await queue.stop()
        self._models = [model for model in self._models if model.info.name != name]

    def cancel(self, job: Job) -> None:
        """Nothing to send: the queue sees the cancelled future and drops the items."""
