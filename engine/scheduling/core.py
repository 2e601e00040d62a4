"""The engine process's core: every front end's jobs go into one batching queue per model.

Each front end connects once (engine/scheduling/ipc.py's `Link`) and sends `Submit` messages (token
ids as raw arrays), which a reader thread per front end enqueues; the queues batch across
all front ends; each batch's finished jobs go back to their front ends as raw float32
outputs, one message per front end per batch, sent from the forward worker that computed
them. So a call's path through this process is threads handing over under locks, with no
event-loop turn on it. A `Cancel` drops a job's queued items, as does a front end's link
closing. Deadlines and the queue bound are enforced here, as in-process. A `Ping` is
answered with a `Pong` from the reader thread, so a front end notices an engine that has
stopped reading (engine/scheduling/remote_client.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import logging
import math
import os
import socket
import threading
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from pooling_server.engine.caching.cache import CacheSettings
from pooling_server.engine.errors import ErrorKind, PoolingError
from pooling_server.engine.inputs.modality import Frame
from pooling_server.engine.inputs.tokenization import TokenSequence
from pooling_server.engine.scheduling.batch_queue import BatchConfig, BatchQueue
from pooling_server.engine.scheduling.engine_client import LocalEngineClient
from pooling_server.engine.scheduling.ipc import (
    ADAPTER_BASE,
    IDS,
    OUTPUTS,
    Cancel,
    ErrorInfo,
    JobResult,
    Link,
    LoadModel,
    ModelChanged,
    ModelLoaded,
    Pong,
    Results,
    Submit,
    UnloadModel,
    Withdrawn,
    encoder,
    start_daemon,
    to_engine_decoder,
)
from pooling_server.engine.scheduling.jobs import Job, Partial, RequestTiming

log = logging.getLogger(__name__)

ACCEPT_POLL_S = 0.2  # how often the acceptor looks up from an idle socket, to notice stop()


# A received sequence's offsets and special-token marks: the engine never reads them, and
# two new empty lists per item cost more than sharing these (nothing appends to them).
_UNMARKED: list = []


def _raws(raws: list[np.ndarray]) -> list[np.ndarray]:
    """An engine process returns raw outputs: heads run in the front end."""
    return raws


class _FrontEnd:
    """A connected front end: its link, its jobs not yet answered, by id, and the unloads
    it has been told of and not yet answered (`Withdrawn`), by id."""

    __slots__ = ("jobs", "link", "withdrawing")

    def __init__(self, link: Link) -> None:
        self.link = link
        self.jobs: dict[int, Job] = {}
        self.withdrawing: dict[int, asyncio.Future[None]] = {}


class RunTimeModels(Protocol):
    """Loads a model a front end asks for at run time, and hands memory back after an
    unload (service/split/engine_process.py: torch, the command line's parsing)."""

    async def load(self, message: LoadModel) -> tuple[Any, bytes, int]:
        """(the LoadedModel, its description as JSON, its weights' bytes)."""
        ...

    async def release(self) -> None: ...


class EngineCore:
    def __init__(
        self,
        models: Sequence[object],
        config: BatchConfig,
        address: str,
        run_time: RunTimeModels | None = None,
        cache: CacheSettings | None = None,
    ) -> None:
        """`models`: LoadedModels; `address`: the Unix socket path front ends connect to;
        `run_time`: how models load and unload at run time (None: they do not); `cache`:
        the result cache's settings (its tiers live here, shared by every front end)."""
        self.client = LocalEngineClient(models, config, cache)  # type: ignore[arg-type]
        self.run_time = run_time
        self.address = address
        self._front_ends: list[_FrontEnd] = []
        self._acceptor: threading.Thread | None = None
        self._readers: list[threading.Thread] = []
        self._stopping = False
        # Run-time models: each name's one load or unload under way, shared by every front
        # end asking for it; and each loaded one's answer (description, bytes, source).
        self._managing: dict[str, asyncio.Task[tuple[bytes, int]]] = {}
        self._loaded: dict[str, tuple[bytes, int, str]] = {}
        self._keys = itertools.count(1)

    @property
    def queues(self) -> dict[str, BatchQueue]:
        return self.client.queues

    async def start(self) -> None:
        """Load the queues (warming every model) and listen; front ends may then connect."""
        await self.client.start()
        # The models' object graph (torch, transformers: millions of objects) is loaded
        # for good: frozen out of the collector, which the per-item allocations of a busy
        # engine would otherwise run over it in full every few batches (half its CPU).
        gc.freeze()
        self._loop = asyncio.get_running_loop()
        # Every job's future: nothing awaits one here, results go out on the links, and a
        # cancel marks the job failed (the queue drops failed jobs' items), so one future
        # that never resolves serves all, rather than one made per job (~0.3 us, a GC object).
        self._unwatched: asyncio.Future[None] = self._loop.create_future()
        for queue in self.queues.values():
            queue.deliver = self._send
            queue.told_of_cancels = True  # _cancel tells them
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.address)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.address)
        self._listener.listen(64)
        self._listener.settimeout(ACCEPT_POLL_S)

    async def serve(self) -> None:
        """Take front ends' messages (on threads of their own) until cancelled."""
        self._acceptor = start_daemon(self._accept, "engine-accept")
        await self._loop.create_future()

    async def stop(self) -> None:
        """No new front ends first, then every link closed and its reader gone."""
        self._stopping = True
        if self._acceptor is not None:
            await asyncio.to_thread(self._acceptor.join)
        self._listener.close()
        for front_end in self._front_ends:
            front_end.link.close()
        for thread in self._readers:
            await asyncio.to_thread(thread.join)
        await self.client.stop()

    def _accept(self) -> None:
        while not self._stopping:
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:  # closed by stop()
                return
            sock.settimeout(None)
            front_end = _FrontEnd(Link(sock))
            self._front_ends.append(front_end)
            name = f"engine-link-{len(self._front_ends)}"
            self._readers.append(start_daemon(self._receive, name, front_end))

    def _receive(self, front_end: _FrontEnd) -> None:
        """One front end's messages, until its link closes; then its queued jobs are dropped."""
        while (message := front_end.link.read()) is not None:
            header, payload = message
            try:
                decoded = to_engine_decoder.decode(header)
                if isinstance(decoded, Submit):
                    self._submit(front_end, decoded, payload)
                elif isinstance(decoded, Cancel):
                    self._loop.call_soon_threadsafe(self._cancel, front_end, decoded.ids)
                elif isinstance(decoded, (LoadModel, UnloadModel)):  # on the loop, off this
                    # reader: Pings are answered while the weights load
                    asyncio.run_coroutine_threadsafe(self._manage(front_end, decoded), self._loop)
                elif isinstance(decoded, Withdrawn):
                    self._loop.call_soon_threadsafe(self._withdrawn, front_end, decoded.id)
                else:  # a stall check: answered from here, so a wedged process is seen
                    with contextlib.suppress(OSError):
                        front_end.link.send(encoder.encode(Pong(decoded.sent)))
            except Exception:  # a bad message must not stop the engine for everyone
                log.exception("dropped a message the engine could not read")
        with contextlib.suppress(RuntimeError):  # the loop closed at shutdown
            self._loop.call_soon_threadsafe(self._cancel, front_end, list(front_end.jobs))
            for key in list(front_end.withdrawing):  # a front end gone routes nothing
                self._loop.call_soon_threadsafe(self._withdrawn, front_end, key)

    def _submit(self, front_end: _FrontEnd, message: Submit, payload: bytearray) -> None:
        """On the front end's reader thread: the message's jobs into their models' queues."""
        count = sum(sum(header.lengths) for header in message.jobs)
        ids = np.frombuffer(payload, dtype=IDS, count=count)
        types = None
        if message.with_types:
            types = np.frombuffer(payload, dtype=IDS, count=count, offset=count * IDS.itemsize)
        # An image model's pixels follow the ids (and types): float32, frame after frame.
        pixels = (1 + message.with_types) * count * IDS.itemsize
        frames = (
            np.frombuffer(payload, dtype=OUTPUTS, offset=pixels) if len(payload) > pixels else None
        )
        by_model: dict[str, list[Job]] = {}
        offset = 0
        for header in message.jobs:
            work = []
            for k, n in enumerate(header.lengths):
                if header.frames and header.frames[k]:
                    assert frames is not None
                    patches, *shape = header.frames[k]
                    size = math.prod(shape)
                    frame = frames[:size].reshape(shape)
                    frames = frames[size:]
                    work.append((Frame(frame, patches), header.keep_tokens))
                    continue
                end = offset + n
                token_types = None if types is None else types[offset:end]
                sequence = TokenSequence(ids[offset:end], token_types, _UNMARKED, _UNMARKED)
                pools = header.pools[k] if header.pools else None
                keep = tuple(pools) if pools else header.keep_tokens
                work.append((sequence, keep))
                offset = end
            job = Job(  # positionally: keywords cost ~0.2 us a job here
                work,
                _raws,
                self._unwatched,
                header.deadline,
                RequestTiming(),
                message.origin,  # with the client, (origin, client) is the queue's key
                header.client,
                header.id,  # its key
                front_end,
            )
            if header.streams:
                job.streams = True
            if header.cache is not None:
                job.cache = header.cache
            if header.adapter is not None:
                job.adapter = header.adapter
            front_end.jobs[header.id] = job
            by_model.setdefault(header.model, []).append(job)
        refused: list[tuple[Job, object]] = []
        for model, jobs in by_model.items():
            if model not in self.queues:  # front ends know the same models: a bug if not
                log.error("jobs for unknown model %r from front end %d", model, message.origin)
                refused += [(job, KeyError(model)) for job in jobs]
            else:
                refused += self.client.submit(model, jobs)
        if refused:
            self._send(refused)

    async def _manage(self, front_end: _FrontEnd, message: LoadModel | UnloadModel) -> None:
        """Load a model (warm, its queue delivering to the links) or unload one (its queue
        stopped: the front ends route nothing to it and its calls are answered), then say
        so to the front end that asked. Front ends asking for the same model at once share
        its one load (or unload); a model already loaded is answered as it is. A LoRA
        adapter's load or unload goes to `_manage_adapter`."""
        if self._for_adapter(message):
            await self._manage_adapter(front_end, message)
            return
        try:
            if self.run_time is None:
                raise PoolingError(
                    ErrorKind.FAILED_PRECONDITION,
                    "MODEL_LOAD_FAILED",
                    "this engine loads no models at run time",
                )
            name = message.name
            while (under_way := self._managing.get(name)) is not None:
                await asyncio.wait({under_way})
                if isinstance(message, UnloadModel) or name in self._loaded:
                    break  # what it asks was just done (a failed load: tried again below)
            if isinstance(message, LoadModel):
                if name in self._loaded and name in self.queues:
                    description, size, _ = self._loaded[name]
                else:
                    work = self._load(front_end, message)
                    self._managing[name] = task = asyncio.ensure_future(work)
                    try:
                        description, size = await asyncio.shield(task)
                    finally:
                        if self._managing.get(name) is task:
                            del self._managing[name]
                answer = ModelLoaded(message.id, description, size)
            else:
                if name in self._loaded or name in self.queues:
                    self._managing[name] = task = asyncio.ensure_future(
                        self._unload(front_end, name)
                    )
                    try:
                        await asyncio.shield(task)
                    finally:
                        if self._managing.get(name) is task:
                            del self._managing[name]
                answer = ModelLoaded(message.id)
        except Exception as exc:
            if not isinstance(exc, PoolingError):
                log.exception("model %s: the engine failed to load or unload it", message.name)
                exc = PoolingError(
                    ErrorKind.INTERNAL, "MODEL_LOAD_FAILED", f"{type(exc).__name__}: {exc}"
                )
            answer = ModelLoaded(message.id, error=ErrorInfo.of(exc))
        with contextlib.suppress(OSError):  # the front end is gone
            front_end.link.send(encoder.encode(answer))

    def _for_adapter(self, message: LoadModel | UnloadModel) -> bool:
        if isinstance(message, LoadModel):
            return ADAPTER_BASE in message.options
        name = message.name
        return any(
            name in getattr(getattr(queue.runner, "adapters", None), "paths", ())
            for queue in self.queues.values()
        )

    async def _manage_adapter(self, front_end: _FrontEnd, message: LoadModel | UnloadModel) -> None:
        """A LoRA adapter read onto its model's module (or dropped from it) on a thread, the
        queue serving on meanwhile: the runner's adapter turn keeps passes off the layers
        while they change (engine/models/adapters.py). Answered with the bytes it takes.
        The other front ends are told, as of a model (`ModelChanged` with `adapter_on`): of
        a load once it is on the module, of an unload before its matrices go, which then
        wait until each has taken it out of routing and seen its calls answered."""
        from pooling_server.engine.models.loader import load_adapter

        try:
            if isinstance(message, LoadModel):
                base = message.options[ADAPTER_BASE]
                queue = self.queues.get(base)
                if queue is None:
                    raise PoolingError(
                        ErrorKind.NOT_FOUND, "MODEL_NOT_FOUND", f"model {base!r} is not served"
                    )
                runner, name, path = queue.runner, message.name, message.source
                size = await asyncio.to_thread(load_adapter, runner, name, path)  # type: ignore[arg-type]
                change = ModelChanged(0, name, path, b"", size, base)
                for other in self._front_ends:
                    if other is not front_end:
                        with contextlib.suppress(OSError):
                            other.link.send(encoder.encode(change))
                answer = ModelLoaded(message.id, b"", size)
            else:
                for base, queue in list(self.queues.items()):
                    adapters = getattr(queue.runner, "adapters", None)
                    if adapters is not None and message.name in adapters.paths:
                        await self._withdraw_elsewhere(front_end, message.name, base)
                        await asyncio.to_thread(adapters.unload, message.name)
                answer = ModelLoaded(message.id)
        except Exception as exc:
            if not isinstance(exc, PoolingError):
                exc = PoolingError(
                    ErrorKind.FAILED_PRECONDITION,
                    "ADAPTER_LOAD_FAILED",
                    f"{type(exc).__name__}: {exc}",
                )
            answer = ModelLoaded(message.id, error=ErrorInfo.of(exc))
        with contextlib.suppress(OSError):  # the front end is gone
            front_end.link.send(encoder.encode(answer))

    async def _load(self, asker: _FrontEnd, message: LoadModel) -> tuple[bytes, int]:
        """The model loaded and its queue serving; every other front end told of it."""
        assert self.run_time is not None
        loaded, description, size = await self.run_time.load(message)
        queue = await self.client.add_model(loaded)
        queue.deliver = self._send
        queue.told_of_cancels = True
        del loaded
        self._loaded[message.name] = (description, size, message.source)
        for front_end in self._front_ends:
            if front_end is not asker:
                change = ModelChanged(0, message.name, message.source, description, size)
                with contextlib.suppress(OSError):
                    front_end.link.send(encoder.encode(change))
        return description, size

    async def _unload(self, asker: _FrontEnd, name: str) -> None:
        """Every other front end stops routing to the model and sees its calls answered
        (`Withdrawn`), then its queue stops and its memory is handed back."""
        assert self.run_time is not None
        self._loaded.pop(name, None)
        await self._withdraw_elsewhere(asker, name)
        if name in self.queues:
            await self.client.remove_model(name)
        await self.run_time.release()

    async def _withdraw_elsewhere(self, asker: _FrontEnd, name: str, adapter_on: str = "") -> None:
        """Tell every front end but `asker` that model (or adapter on `adapter_on`) `name`
        is being unloaded, and wait until each has answered `Withdrawn`."""
        waits = []
        for front_end in self._front_ends:
            if front_end is asker:
                continue
            key = next(self._keys)
            front_end.withdrawing[key] = told = self._loop.create_future()
            change = ModelChanged(key, name, adapter_on=adapter_on)
            try:
                front_end.link.send(encoder.encode(change))
            except OSError:  # gone: it routes nothing
                front_end.withdrawing.pop(key, None)
                continue
            waits.append(told)
        if waits:
            await asyncio.wait(waits)

    def _withdrawn(self, front_end: _FrontEnd, key: int) -> None:
        """On the loop: a front end routes nothing more to a model being unloaded."""
        told = front_end.withdrawing.pop(key, None)
        if told is not None and not told.done():
            told.set_result(None)

    def _cancel(self, front_end: _FrontEnd, ids: Sequence[int]) -> None:
        """On the loop: a cancelled job's queued items are dropped; nothing is sent back."""
        for key in ids:
            job = front_end.jobs.pop(key, None)
            if job is not None:  # a lone flag: a worker that reads it late finds no owner
                job.failed = True
        for queue in self.queues.values():  # after the cancels, so the next walk sees them
            queue.cancelled()

    def _send(self, outcomes: Sequence[tuple[Job, object]]) -> None:
        """On any thread: each outcome (raw outputs or an error) to its front end, in one
        message per front end."""
        by_front_end: dict[_FrontEnd, list[tuple[Job, object]]] = {}
        for answer in outcomes:
            job, outcome = answer
            front_end: _FrontEnd = job.reply_to
            # Whoever takes a job from its front end's table answers it (here) or drops it
            # (a cancel): not there, it was cancelled. A streaming job's part leaves it there.
            if type(outcome) is Partial and not outcome.last:
                if job.key in front_end.jobs:
                    by_front_end.setdefault(front_end, []).append(answer)
            elif front_end.jobs.pop(job.key, None) is not None:
                by_front_end.setdefault(front_end, []).append(answer)
        for front_end, answered in by_front_end.items():
            header, data = _message(answered)
            with contextlib.suppress(OSError):  # the front end is gone: its link closes
                front_end.link.send(header, [data])


def _message(answered: Sequence[tuple[Job, object]]) -> tuple[bytes, np.ndarray]:
    """A `Results` header, and every answer's outputs as one float32 buffer.

    Vectors (the usual raw output) join the buffer as they are, cast to float32 by the one
    concatenate: a cast and a reshape each cost ~1 us an output. One loop, no comprehension
    per job: most jobs have one output."""
    results: list[JobResult] = []
    arrays: list[np.ndarray] = []
    for job, outcome in answered:
        timing = job.timing
        shapes: list[list[int]] = []
        indices = None
        if isinstance(outcome, BaseException):
            info: ErrorInfo | None = ErrorInfo.of(outcome)
        else:
            info = None
            if type(outcome) is Partial:
                indices, outcome = outcome.indices, outcome.raws
            for raw in outcome:  # type: ignore[attr-defined]
                shapes.append(raw.shape)  # type: ignore[arg-type]  # msgpack: an array either way
                arrays.append(raw if raw.ndim == 1 else raw.reshape(-1))
        results.append(
            JobResult(
                job.key,
                shapes,
                info,
                timing.enqueued,
                timing.started,
                timing.finished,
                indices,
                job.cached,
            )
        )
    data = np.concatenate(arrays, dtype=OUTPUTS) if arrays else np.empty(0, OUTPUTS)
    return encoder.encode(Results(results)), data
