"""LoRA adapters at run time: routed at start (--adapter), loaded and unloaded by an admin.

An adapter is served under its own name on one base model (engine/models/adapters.py
computes it; the engine's `adapters` table routes to it, Engine._adapted). This module is
the front end's side and stays torch-free: the weights are touched only through
service/loading.py, imported where a load runs.

The admin's calls are the model repository's (service/repository.py hands them here): a
Load whose options name `base-model` loads an adapter, an Unload naming an adapter unloads
it, and List shows adapters with their parent. vLLM's /v1/load_lora_adapter and
/v1/unload_lora_adapter (service/http/repository.py) call the same two.

- Load: the adapter's folder is read onto the base model's module on a thread of its own
  at the loads' lower priority (service/loading.py's load_aside), in turn with the other
  adapter loads; only then is the name routed to.
- Unload: out of routing first, then its calls already resolved answered
  (ModelUse.drained), then its matrices dropped and memory handed back.
- A split server sends the load or unload to every engine process over its IPC link
  (engine/scheduling/core.py's `_manage_adapter`), and answers once all have, unloading it
  again from those that had if any failed. With --frontends above 1 the engines tell the
  other front ends, as of a model (`ModelChanged` naming the adapter's model, `learned`
  here): one routes the adapter once every live engine has it, and answers an unload's
  notice (`Withdrawn`) once the name is out of its routing and its calls are answered;
  only then does that engine drop the matrices.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from pooling_server.engine.errors import ErrorKind, FieldViolation, PoolingError, clip
from pooling_server.engine.models.model_spec import ModelSpec
from pooling_server.engine.scheduling.ipc import ADAPTER_BASE
from pooling_server.service.engine_notices import Notices

if TYPE_CHECKING:
    from pooling_server.engine.scheduling.engine import Engine
    from pooling_server.engine.scheduling.ipc import ModelChanged
    from pooling_server.service.repository import Entry

log = logging.getLogger(__name__)

# The option of a repository Load that makes it an adapter's: the model it goes on.
BASE_MODEL = ADAPTER_BASE


class AdapterManager:
    """The adapters a front end routes to, with their states, for the repository's calls."""

    def __init__(
        self,
        engine: Engine,
        specs: Iterable[ModelSpec],
        frontends: int = 0,
        start_bytes: Mapping[str, int] | None = None,
    ) -> None:
        """`frontends`: the split server's front-end processes (0: one process).
        `start_bytes`: what each --adapter's matrices take, where known."""
        from pooling_server.service.repository import Entry, ModelState

        self.engine = engine
        self.frontends = frontends
        self._entries: dict[str, Entry] = {}
        for spec in specs:
            for name, path in spec.adapters:
                parent = spec.served_name
                entry = Entry(name, path, {BASE_MODEL: parent}, pinned=True, parent=parent)
                entry.state = ModelState.LOADED
                entry.memory_bytes = (start_bytes or {}).get(name, 0)
                self._entries[name] = entry
        self._turn = asyncio.Lock()  # adapter loads take turns, as model loads do
        # Other front ends' loads and unloads (split server, `learned`).
        self.notices = Notices(engine)
        self._draining: dict[str, Any] = {}

    def entries(self) -> list[Entry]:
        """Every adapter routed or on its way, by name; those whose model was unloaded
        (and its adapters with it) are forgotten."""
        from pooling_server.service.repository import ModelState

        routed = self.engine.adapters
        for name, entry in list(self._entries.items()):
            if entry.state is ModelState.LOADED and name not in routed:
                del self._entries[name]
        return sorted(self._entries.values(), key=lambda e: e.name)

    def entry(self, name: str) -> Entry | None:
        return self._entries.get(name) if name in self.engine.adapters else None

    async def load(self, name: str, path: str, model: str) -> Entry:
        """Load the adapter at `path` onto `model` ("" for the default model) as `name`;
        answers once it is routed. The same adapter again answers as it is."""
        from pooling_server.service.repository import Entry, ModelState, check_name

        check_name(name)
        entry = self._entries.get(name)
        if entry is not None and name in self.engine.adapters:
            if entry.source == path and entry.parent == (model or entry.parent):
                return entry
            raise _taken(name, f"adapter on {entry.parent} from {entry.source}")
        if entry is not None:  # loading now
            raise _taken(name, "adapter being loaded")
        if self.engine.serves(name) and name:
            raise _taken(name, "served model")
        if not path:
            raise PoolingError.invalid(
                [FieldViolation("source", "an adapter's folder is required", "ADAPTER_PATH")]
            )
        base = self.engine.model_named(model).info.name  # MODEL_NOT_FOUND if unknown
        entry = self._entries[name] = Entry(
            name, path, {BASE_MODEL: base}, parent=base, state=ModelState.LOADING
        )
        started = time.monotonic()
        try:
            async with self._turn:
                size = await self._attach(base, name, path)
        except Exception as exc:
            self._entries.pop(name, None)
            log.warning("adapter %s failed to load on %s: %s", name, base, exc)
            raise load_failed(name, base, f"{type(exc).__name__}: {exc}") from None
        if not self.engine.serves(base):  # its model was unloaded meanwhile
            self._entries.pop(name, None)
            raise load_failed(name, base, "its model was unloaded while it loaded")
        self.engine.add_adapter(name, base)
        entry.state, entry.memory_bytes = ModelState.LOADED, size
        entry.load_seconds = time.monotonic() - started
        log.info("adapter %s loaded on %s in %.2fs", name, base, entry.load_seconds)
        return entry

    async def unload(self, name: str) -> Entry:
        """Out of routing, its calls answered, then its matrices dropped."""
        from pooling_server.service.repository import ModelState

        base = self.engine.adapters.get(name)
        entry = self._entries.get(name)
        if base is None or entry is None:
            raise adapter_not_found(name)
        entry.state = ModelState.UNLOADING
        self.notices.told.pop(name, None)
        try:
            await self.engine.remove_adapter(name).drained()
            await self._detach(base, name)
        finally:
            self._entries.pop(name, None)
            entry.state, entry.memory_bytes = ModelState.AVAILABLE, 0
        log.info("adapter %s unloaded from %s", name, base)
        return entry

    # ------------------------------------------- what other front ends did (split server)

    def learned(self, engine: int, change: ModelChanged) -> None:
        """On the loop: engine `engine` says another front end loaded adapter `change.name`
        on it, or is unloading it. A load is routed here once every live engine has told
        of it; an unload is answered to each engine once the name is out of routing here
        and its calls here are answered."""
        if not change.unloading:
            if self.notices.all_told(engine, change.name):
                self._adopt(change)
            return
        self.notices.unloading(engine, change, self._withdraw)

    def _adopt(self, change: ModelChanged) -> None:
        """Route an adapter another front end loaded on every engine."""
        from pooling_server.service.repository import Entry, ModelState

        name, base = change.name, change.adapter_on
        entry = self._entries.get(name)
        if name in self.engine.adapters or (entry and entry.state is not ModelState.LOADED):
            return  # routed already, or this front end's own load or unload of it under way
        if not self.engine.serves(base):
            log.warning("adapter %s was loaded on %s, which is not served here", name, base)
            return
        try:
            self.engine.add_adapter(name, base)
        except ValueError as exc:  # a model of that name is served here
            log.error("adapter %s loaded by another front end not routed: %s", name, exc)
            return
        entry = Entry(name, change.source, {BASE_MODEL: base}, parent=base)
        entry.state, entry.memory_bytes = ModelState.LOADED, change.memory_bytes
        self._entries[name] = entry
        log.info("adapter %s loaded on %s by another front end: routed here too", name, base)

    async def _withdraw(self, name: str) -> None:
        """Out of routing here, and every call here to it answered (another front end is
        unloading it)."""
        from pooling_server.service.repository import ModelState

        draining = self._draining.get(name)
        if draining is None and name in self.engine.adapters:
            entry = self._entries.get(name)
            if entry is not None:
                entry.state = ModelState.UNLOADING
            draining = self._draining[name] = self.engine.remove_adapter(name)
            try:
                await draining.drained()
            finally:
                self._draining.pop(name, None)
                if entry is not None and self._entries.get(name) is entry:
                    del self._entries[name]
                    entry.state, entry.memory_bytes = ModelState.AVAILABLE, 0
            log.info("adapter %s unloaded by another front end: out of routing here", name)
        elif draining is not None:
            await draining.drained()

    async def _attach(self, base: str, name: str, path: str) -> int:
        """The adapter's weights read onto `base` wherever it computes: its bytes."""
        queue = self.engine.queues.get(base)
        if queue is not None:  # in this process
            from pooling_server.engine.models.loader import load_adapter  # torch: only here
            from pooling_server.service.loading import load_aside

            return await load_aside(load_adapter, queue.runner, name, path)
        from pooling_server.engine.scheduling.ipc import LoadModel, UnloadModel

        client = self.engine.client
        options = {ADAPTER_BASE: base}
        answers = await client.manage(lambda key: LoadModel(key, name, path, options))  # type: ignore[attr-defined]
        failed = [(k, a.error) for k, a in answers if a.error is not None]
        if failed or not answers:
            loaded = [k for k, a in answers if a.error is None]
            if loaded:
                await client.manage(lambda key: UnloadModel(key, name), loaded)  # type: ignore[attr-defined]
            said = "; ".join(f"engine {k}: {e.message}" for k, e in failed if e is not None)
            raise ValueError(said or "no engine is serving")
        return max(a.memory_bytes for _, a in answers)

    async def _detach(self, base: str, name: str) -> None:
        queue = self.engine.queues.get(base)
        if queue is not None:
            from pooling_server.service.loading import release_memory

            await asyncio.to_thread(queue.runner.adapters.unload, name)  # type: ignore[union-attr]
            await asyncio.to_thread(release_memory)
            return
        from pooling_server.engine.scheduling.ipc import UnloadModel

        client = self.engine.client
        for engine, answer in await client.manage(lambda key: UnloadModel(key, name)):  # type: ignore[attr-defined]
            if answer.error is not None:
                log.error("engine %d failed to drop adapter %s: %s", engine, name, answer.error)


def adapter_not_found(name: str) -> PoolingError:
    return PoolingError(
        ErrorKind.NOT_FOUND,
        "ADAPTER_NOT_FOUND",
        f'adapter "{clip(name)}" is not loaded',
        (FieldViolation("name", "not a loaded adapter", "ADAPTER_NOT_FOUND"),),
    )


def load_failed(name: str, model: str, why: str) -> PoolingError:
    return PoolingError(
        ErrorKind.FAILED_PRECONDITION,
        "ADAPTER_LOAD_FAILED",
        f'adapter "{clip(name)}" did not load on model "{clip(model)}": {clip(why, 500)}',
    )


def _taken(name: str, what: str) -> PoolingError:
    return PoolingError.invalid(
        [FieldViolation("name", f'"{clip(name)}" already names a {what}', "ADAPTER_NAME_TAKEN")]
    )
