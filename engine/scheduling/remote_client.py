"""The engine client of a front-end process: jobs go to engine processes over their links.

Tokenizer threads send jobs (token ids as one array per message) on the link to an engine
(engine/scheduling/ipc.py); a reader thread per engine takes raw outputs back, applies each
request's
heads and resolves the futures with one event-loop call per message. Each job goes to the
serving engine with the fewest items outstanding from this front end.

An engine's death shows as its link closing, and as end-of-file on a pipe whose write end
only that engine holds: every call waiting on it fails at once with UNAVAILABLE /
ENGINE_DEAD, and later jobs go to the engines left. A wedged engine (stopped, or stuck with
its link unread) shows as a `Ping` unanswered for `stall_s`: it is marked stalled and jobs
go around it, while the calls it holds keep waiting, since it may come back; stalled for
`STALL_KILL_FACTOR` times as long, it is killed and handled as dead.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import select
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from pooling_server.engine.errors import ErrorKind, PoolingError
from pooling_server.engine.inputs.modality import Frame
from pooling_server.engine.scheduling.batch_queue import BatchQueue
from pooling_server.engine.scheduling.ipc import (
    IDS,
    OUTPUTS,
    Cancel,
    EngineReady,
    ErrorInfo,
    JobHeader,
    Link,
    LoadModel,
    ModelChanged,
    ModelLoaded,
    Ping,
    Pong,
    Results,
    Submit,
    UnloadModel,
    Withdrawn,
    encoder,
    from_engine_decoder,
    start_daemon,
    unpack_outputs,
)
from pooling_server.engine.scheduling.jobs import Job, settle

log = logging.getLogger(__name__)

POLL_MS = 200  # how often the liveness watcher looks up, to notice stop()
DEFAULT_STALL_S = 5.0
# A job of this many sequences streams its outputs (JobHeader.streams): the engine sends
# each batch's as it ends, so it holds none and no answer is one message of them all.
STREAM_ITEMS = 64
# A stalled engine that stays so this many times --engine-stall-s is killed: a frozen
# process would otherwise hold its calls, and its share of the device, forever.
STALL_KILL_FACTOR = 6.0


def engine_dead() -> PoolingError:
    return PoolingError(
        ErrorKind.UNAVAILABLE,
        "ENGINE_DEAD",
        "the engine process computing this request died; retry it (other engines serve "
        "on, or the server restarts)",
        retry_after_s=1.0,
    )


@dataclass(slots=True)
class _Sent:
    job: Job
    engine: int
    items: int


class RemoteEngineClient:
    def __init__(
        self,
        engines: Sequence[EngineReady],
        origin: int = 0,
        alive_fds: Sequence[int] = (),
        on_engines_changed: Callable[[], None] | None = None,
        stall_s: float = DEFAULT_STALL_S,
    ) -> None:
        """`alive_fds[k]`: the read end of engine k's liveness pipe; `on_engines_changed`
        is called on the event loop when an engine dies, stalls or comes back; `stall_s`:
        an engine silent this long after a Ping is stalled (0: never checked)."""
        self.engines = list(engines)
        self.origin = origin
        self.alive_fds = list(alive_fds)
        self.on_engines_changed = on_engines_changed
        self.stall_s = stall_s
        self.dead: set[int] = set()
        self.stalled: set[int] = set()
        self.stalls = [0] * len(self.engines)  # how often each engine stalled
        self._links: list[Link] = []
        self._sent: dict[int, _Sent] = {}
        self._outstanding = [0] * len(self.engines)  # items sent and not yet answered
        self._keys = itertools.count(1)
        self._lock = threading.Lock()  # the choice of engine, the counts, the states
        self._heard = [0.0] * len(self.engines)  # when each engine last sent anything
        self._owes_pong = [False] * len(self.engines)
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._threads: list[threading.Thread] = []
        # Loads and unloads sent to the engines (manage), by key: (engine, its answer).
        self._managing: dict[int, tuple[int, asyncio.Future[ModelLoaded]]] = {}
        # Called on the loop with (engine, message) when an engine says another front end
        # loaded or is unloading a model (service/repository.py's ModelManager.learned).
        self.on_model_changed: Callable[[int, ModelChanged], None] | None = None

    @property
    def serving(self) -> bool:
        """Some engine can take a job now: neither dead nor stalled."""
        return len(self.dead | self.stalled) < len(self.engines)

    @property
    def queues(self) -> dict[str, BatchQueue]:
        return {}

    async def start(self) -> None:
        # The heads run here, in numpy, on each engine's results reader. OpenBLAS's second
        # thread only waits for a core on a busy host: MaxSim's products of 32 x 128 by
        # 128 x 512 took ~10 ms each so, against 0.1 ms on one (issue 43, row 8). The engine
        # processes keep one too (service/loading.py).
        from threadpoolctl import threadpool_limits

        threadpool_limits(1, user_api="blas")
        self._loop = asyncio.get_running_loop()
        self._links = [Link.connect(engine.address) for engine in self.engines]
        self._heard = [time.monotonic()] * len(self.engines)
        self._threads = [
            start_daemon(self._receive, f"engine-results-{index}", index, link)
            for index, link in enumerate(self._links)
        ]
        if self.alive_fds or self.stall_s:
            self._threads.append(start_daemon(self._watch, "engine-liveness"))

    async def stop(self) -> None:
        self._stopping = True
        for link in self._links:
            link.close()
        for thread in self._threads:
            await asyncio.to_thread(thread.join)

    def submit(self, model: str, jobs: Sequence[Job]) -> list[tuple[Job, PoolingError]]:
        by_engine: dict[int, list[Job]] = {}
        with self._lock:
            choices = self._choices()
            if not choices:
                return [(job, engine_dead()) for job in jobs]
            for job in jobs:
                engine = min(choices, key=self._outstanding.__getitem__)
                self._outstanding[engine] += len(job.work)
                job.key = next(self._keys)
                self._sent[job.key] = _Sent(job, engine, len(job.work))
                by_engine.setdefault(engine, []).append(job)
        refused: list[tuple[Job, PoolingError]] = []
        for engine, sent in by_engine.items():
            header, payload = self._message(model, sent)
            try:
                self._links[engine].send(header, payload)
            except OSError:  # the engine is gone: these fail here, unless its reader has
                refused += [(job, engine_dead()) for job in sent if self._forget(job.key)]
        return refused

    async def manage(
        self,
        message: Callable[[int], LoadModel | UnloadModel],
        engines: Sequence[int] | None = None,
    ) -> list[tuple[int, ModelLoaded]]:
        """A load or unload (`message(key)`) sent to every live engine (or `engines`),
        and each one's answer, by engine: an engine that dies meanwhile answers
        ENGINE_DEAD."""
        loop = asyncio.get_running_loop()
        waits: list[tuple[int, asyncio.Future[ModelLoaded]]] = []
        for engine, link in enumerate(self._links):
            if engine in self.dead or (engines is not None and engine not in engines):
                continue
            key = next(self._keys)
            answer: asyncio.Future[ModelLoaded] = loop.create_future()
            self._managing[key] = (engine, answer)
            try:
                link.send(encoder.encode(message(key)))
            except OSError:
                self._managing.pop(key, None)
                answer.set_result(ModelLoaded(key, error=ErrorInfo.of(engine_dead())))
            waits.append((engine, answer))
        return [(engine, await answer) for engine, answer in waits]

    def _managed(self, answer: ModelLoaded) -> None:
        """On the loop: an engine's answer to a load or unload."""
        waiting = self._managing.pop(answer.id, None)
        if waiting is not None and not waiting[1].done():
            waiting[1].set_result(answer)

    def _model_changed(self, engine: int, message: ModelChanged) -> None:
        if self.on_model_changed is not None:
            self.on_model_changed(engine, message)
        elif message.unloading:  # nothing here routes run-time models
            self.withdrawn(engine, message.id)

    def withdrawn(self, engine: int, key: int) -> None:
        """Tell `engine` that this front end routes nothing more to the model its unloading
        ModelChanged `key` named, and that its calls there are answered."""
        with contextlib.suppress(OSError):  # a dead engine waits for nothing
            self._links[engine].send(encoder.encode(Withdrawn(key)))

    def _choices(self) -> list[int]:
        """The engines a job may go to (under the lock): the serving ones; while every live
        one is stalled, those (the job waits, as their calls do, in case they come back)."""
        alive = [k for k in range(len(self.engines)) if k not in self.dead]
        return [k for k in alive if k not in self.stalled] or alive

    def _message(self, model: str, jobs: Sequence[Job]) -> tuple[bytes, list[bytes]]:
        headers, ids, types = [], [], []
        pixels: list[np.ndarray] = []  # each image's frame, sent as it lies (no copy)
        with_types = all(e.token_type_ids is not None for job in jobs for e, _ in job.work)
        for job in jobs:
            lengths = []
            frames: list[list[int]] = []
            for sequence, _ in job.work:
                if type(sequence) is Frame:
                    frames += [[] for _ in range(len(lengths) - len(frames))]
                    frames.append([sequence.patches, *sequence.pixels.shape])
                    pixels.append(sequence.pixels)
                    lengths.append(0)
                    continue
                lengths.append(len(sequence))
                ids.extend(sequence.input_ids)
                if with_types:
                    types.extend(sequence.token_type_ids)  # type: ignore[arg-type]
            if frames:
                frames += [[] for _ in range(len(lengths) - len(frames))]
            first = job.work[0][1] if job.work else False
            keep = not isinstance(first, tuple) and bool(first)
            # Late chunking's token ranges per sequence (tuples), else none.
            pools = [list(k) if isinstance(k, tuple) else [] for _, k in job.work]
            pools = pools if any(pools) else []
            streams = job.fold is not None or len(lengths) >= STREAM_ITEMS
            job.streams = streams
            headers.append(
                JobHeader(
                    job.key,
                    model,
                    job.deadline,
                    keep,
                    lengths,
                    job.client,
                    pools,
                    frames,
                    streams,
                    job.adapter,
                    job.cache,
                )
            )
        payload: list[bytes | np.ndarray] = [np.array(ids, dtype=IDS).tobytes()]
        if with_types:
            payload.append(np.array(types, dtype=IDS).tobytes())
        payload += [np.ascontiguousarray(frame, dtype=OUTPUTS) for frame in pixels]
        return encoder.encode(Submit(self.origin, with_types, headers)), payload

    def cancel(self, job: Job) -> None:
        # The engine answers nothing for a cancelled job: forget it here, or its items stay
        # outstanding (steering later jobs away from that engine) and its entry stays kept.
        sent = self._forget(job.key)
        if sent is None or sent.engine in self.dead:
            return
        with contextlib.suppress(OSError):
            self._links[sent.engine].send(encoder.encode(Cancel([job.key])))

    def _forget(self, key: int) -> _Sent | None:
        """A job answered or cancelled: no longer sent, its items no longer outstanding."""
        with self._lock:
            sent = self._sent.pop(key, None)
            if sent is not None:
                self._outstanding[sent.engine] -= sent.items
        return sent

    def _receive(self, engine: int, link: Link) -> None:
        """Engine `engine`'s results, until its link closes: by stop(), or by its death."""
        while (message := link.read()) is not None:
            header, payload = message
            self._heard[engine] = time.monotonic()
            decoded = from_engine_decoder.decode(header)
            if isinstance(decoded, Pong):
                self._owes_pong[engine] = False
            elif isinstance(decoded, ModelLoaded):
                self._call_in_loop(self._managed, decoded)
            elif isinstance(decoded, ModelChanged):
                self._call_in_loop(self._model_changed, engine, decoded)
            else:
                self._take_results(decoded, payload)
            if engine in self.stalled:
                self._recovered(engine)
        if not self._stopping:
            self._engine_died(engine)

    def _watch(self) -> None:
        """End of file on an engine's liveness pipe: it died (even if its link is stuck).
        Between looks, each engine not waiting on a Ping is sent one; an engine that owes a
        Pong and has sent nothing for `stall_s` is stalled."""
        poller = select.poll()
        for fd in self.alive_fds:
            poller.register(fd, select.POLLIN)
        every_ms = POLL_MS if not self.stall_s else min(POLL_MS, self.stall_s * 100)
        while not self._stopping:
            for fd, _ in poller.poll(every_ms):
                if not os.read(fd, 1):  # end of file: the engine's end is closed
                    poller.unregister(fd)
                    self._engine_died(self.alive_fds.index(fd))
            if self.stall_s and not self._stopping:
                self._check_stalls(time.monotonic())

    def _check_stalls(self, now: float) -> None:
        """On the watcher: ping the engines that owe no Pong; mark, or kill, the silent."""
        for engine, link in enumerate(self._links):
            if engine in self.dead:
                continue
            if not self._owes_pong[engine]:
                self._owes_pong[engine] = True
                with contextlib.suppress(OSError):  # a dead link shows on its reader
                    link.send(encoder.encode(Ping(now)))
                continue
            # A live engine answers each Ping within a poll, so it is never silent for long.
            silent = now - self._heard[engine]
            if silent >= self.stall_s * STALL_KILL_FACTOR:
                pid = self.engines[engine].pid
                log.error("engine process %d silent for %.0fs: killing it", pid, silent)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
                self._engine_died(engine)
            elif silent >= self.stall_s and engine not in self.stalled:
                with self._lock:
                    self.stalled.add(engine)
                    self.stalls[engine] += 1
                log.error(
                    "engine process %d has not answered for %.1fs: stalled, routing around it",
                    self.engines[engine].pid,
                    silent,
                )
                self._changed()

    def _recovered(self, engine: int) -> None:
        with self._lock:
            if engine not in self.stalled:
                return
            self.stalled.discard(engine)
        log.warning("engine process %d answers again: serving", self.engines[engine].pid)
        self._changed()

    def _changed(self) -> None:
        if self.on_engines_changed is not None:
            self._call_in_loop(self.on_engines_changed)

    def _take_results(self, message: Results, payload: bytearray) -> None:
        data = np.frombuffer(payload, dtype=OUTPUTS)
        outcomes: list[tuple[Job, object]] = []
        offset = 0
        for result in message.results:
            if result.error is None:
                raws, offset = unpack_outputs(data, offset, result.shapes)
                if result.indices is not None:  # a streaming job's part
                    if not self._gathered(result.id, result.indices, raws):
                        continue  # more to come
                    gathered = self._sent.get(result.id)
                    if gathered is None:  # cancelled meanwhile, on the loop
                        continue
                    raws = gathered.job.raws
            sent = self._forget(result.id)
            if sent is None or sent.job.future.done():
                continue
            job = sent.job
            job.timing.enqueued = result.enqueued
            job.timing.started, job.timing.finished = result.started, result.finished
            job.cached = result.cached
            if result.error is not None:
                outcomes.append((job, result.error.error()))
                continue
            try:
                outcomes.append((job, job.finish(raws)))
            except Exception as exc:
                log.exception("finishing a request failed")
                outcomes.append((job, exc))
        self._call_in_loop(settle, outcomes)

    def _gathered(self, key: int, indices: list[int], raws: list[np.ndarray]) -> bool:
        """A streaming job's part into its raws (each folded, when the job folds); True
        once every sequence has come, or its caller has gone (it is then forgotten)."""
        sent = self._sent.get(key)
        if sent is None:  # cancelled, or failed by a fold
            return False
        job = sent.job
        if job.future.done():
            return True
        fold = job.fold
        for index, raw in zip(indices, raws, strict=True):
            if fold is None:
                job.raws[index] = raw
                continue
            try:
                job.raws[index] = fold(index, raw)
            except Exception as exc:
                log.exception("finishing a request's output failed")
                self._forget(key)
                self._call_in_loop(settle, [(job, exc)])
                return False
        job.remaining -= len(raws)
        return job.remaining <= 0

    def _engine_died(self, engine: int) -> None:
        with self._lock:
            if engine in self.dead:  # seen on its link and on its pipe
                return
            self.dead.add(engine)
            self.stalled.discard(engine)
        log.error("engine process %d died", self.engines[engine].pid)
        self._links[engine].close()
        with self._lock:
            lost = [key for key, sent in self._sent.items() if sent.engine == engine]
            outcomes: list[tuple[Job, object]] = [
                (self._sent.pop(key).job, engine_dead()) for key in lost
            ]
        self._call_in_loop(settle, outcomes)
        self._call_in_loop(self._fail_managing, engine)
        self._changed()

    def _fail_managing(self, engine: int) -> None:
        """On the loop: a dead engine's loads and unloads under way answer ENGINE_DEAD."""
        for key, (owner, _) in list(self._managing.items()):
            if owner == engine:
                self._managed(ModelLoaded(key, error=ErrorInfo.of(engine_dead())))

    def _call_in_loop(self, callback: Callable[..., None], *args: object) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop closed at shutdown: nobody waits
            self._loop.call_soon_threadsafe(callback, *args)
