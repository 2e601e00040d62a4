"""The engine client of a front-end process: jobs go to engine processes over ZMQ.

Tokenizer threads send jobs (token ids as one array per message) on sockets of their own;
one receiver thread takes raw outputs back, applies each request's heads and resolves the
futures with one event-loop call per message. Each job goes to the engine with the fewest
items outstanding from this front end. An engine's death shows as end-of-file on a pipe
whose write end only that engine holds: every call waiting on it fails at once with
UNAVAILABLE / ENGINE_DEAD.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import zmq

from engine.batch_queue import BatchQueue
from engine.errors import ErrorKind, PoolingError
from engine.ipc import (
    IDS,
    OUTPUTS,
    Cancel,
    EngineReady,
    JobHeader,
    Submit,
    encoder,
    results_decoder,
    unpack_outputs,
)
from engine.jobs import Job, settle

log = logging.getLogger(__name__)

POLL_MS = 200  # how often the receiver looks up from an idle socket, to notice stop()


def engine_dead() -> PoolingError:
    return PoolingError(
        ErrorKind.UNAVAILABLE,
        "ENGINE_DEAD",
        "the engine process computing this request died; the server is restarting",
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
        reply_address: str,
        origin: int = 0,
        alive_fds: Sequence[int] = (),
        on_engine_dead: Callable[[int], None] | None = None,
    ) -> None:
        """`alive_fds[k]`: the read end of engine k's liveness pipe; `on_engine_dead` is
        called on the event loop once an engine dies."""
        self.engines = list(engines)
        self.reply_address = reply_address
        self.origin = origin
        self.alive_fds = list(alive_fds)
        self.on_engine_dead = on_engine_dead
        self.dead: set[int] = set()
        self._context = zmq.Context()
        self._local = threading.local()
        self._sent: dict[int, _Sent] = {}
        self._outstanding = [0] * len(self.engines)  # items sent and not yet answered
        self._keys = itertools.count(1)
        self._lock = threading.Lock()  # the choice of engine and the outstanding counts
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._receiver = threading.Thread(target=self._receive, name="engine-results", daemon=True)

    @property
    def queues(self) -> dict[str, BatchQueue]:
        return {}

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._results = self._context.socket(zmq.PULL)
        self._results.bind(self.reply_address)
        self._receiver.start()

    async def stop(self) -> None:
        self._stopping = True
        await asyncio.to_thread(self._receiver.join)
        self._context.destroy(linger=0)

    def _socket(self, engine: int) -> zmq.Socket[bytes]:
        """This thread's socket to an engine: ZMQ sockets must not be shared by threads."""
        sockets: dict[int, zmq.Socket[bytes]] | None = getattr(self._local, "sockets", None)
        if sockets is None:
            sockets = self._local.sockets = {}
        sock = sockets.get(engine)
        if sock is None:
            sock = sockets[engine] = self._context.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)  # never drop or block: the engine bounds its queue
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.engines[engine].address)
        return sock

    def submit(self, model: str, jobs: Sequence[Job]) -> list[tuple[Job, PoolingError]]:
        if self.dead:
            return [(job, engine_dead()) for job in jobs]
        by_engine: dict[int, list[Job]] = {}
        with self._lock:
            for job in jobs:
                engine = min(range(len(self.engines)), key=self._outstanding.__getitem__)
                self._outstanding[engine] += len(job.work)
                job.key = next(self._keys)
                self._sent[job.key] = _Sent(job, engine, len(job.work))
                by_engine.setdefault(engine, []).append(job)
        for engine, sent in by_engine.items():
            self._socket(engine).send_multipart(self._frames(model, sent), copy=False)
        return []

    def _frames(self, model: str, jobs: Sequence[Job]) -> list[bytes]:
        headers, ids, types = [], [], []
        with_types = all(e.token_type_ids is not None for job in jobs for e, _ in job.work)
        for job in jobs:
            lengths = []
            for sequence, _ in job.work:
                lengths.append(len(sequence))
                ids.extend(sequence.input_ids)
                if with_types:
                    types.extend(sequence.token_type_ids)  # type: ignore[arg-type]
            keep = bool(job.work) and job.work[0][1]
            headers.append(JobHeader(job.key, model, job.deadline, keep, lengths, job.client))
        frames = [
            encoder.encode(Submit(self.reply_address, self.origin, with_types, headers)),
            np.array(ids, dtype=IDS).tobytes(),
        ]
        if with_types:
            frames.append(np.array(types, dtype=IDS).tobytes())
        return frames

    def cancel(self, job: Job) -> None:
        # The engine answers nothing for a cancelled job: forget it here, or its items stay
        # outstanding (steering later jobs away from that engine) and its entry stays kept.
        sent = self._forget(job.key)
        if sent is None or sent.engine in self.dead:
            return
        message = encoder.encode(Cancel(self.reply_address, [job.key]))
        with contextlib.suppress(zmq.ZMQError):
            self._socket(sent.engine).send(message)

    def _forget(self, key: int) -> _Sent | None:
        """A job answered or cancelled: no longer sent, its items no longer outstanding."""
        with self._lock:
            sent = self._sent.pop(key, None)
            if sent is not None:
                self._outstanding[sent.engine] -= sent.items
        return sent

    def _receive(self) -> None:
        poller = zmq.Poller()
        poller.register(self._results, zmq.POLLIN)
        for fd in self.alive_fds:
            poller.register(fd, zmq.POLLIN)
        while not self._stopping:
            for source, _ in poller.poll(POLL_MS):
                if source is self._results:
                    self._take_results(self._results.recv_multipart(copy=False))
                else:
                    if not os.read(source, 1):  # end of file: the engine's end is closed
                        poller.unregister(source)
                        self._engine_died(self.alive_fds.index(source))

    def _take_results(self, frames: list[zmq.Frame]) -> None:
        message = results_decoder.decode(frames[0].buffer)
        data = np.frombuffer(frames[1].buffer, dtype=OUTPUTS) if len(frames) > 1 else None
        outcomes: list[tuple[Job, object]] = []
        offset = 0
        for result in message.results:
            sent = self._forget(result.id)
            if result.error is None and data is not None:
                raws, offset = unpack_outputs(data, offset, result.shapes)
            if sent is None or sent.job.future.done():
                continue
            job = sent.job
            job.timing.enqueued = result.enqueued
            job.timing.started, job.timing.finished = result.started, result.finished
            if result.error is not None:
                outcomes.append((job, result.error.error()))
                continue
            try:
                outcomes.append((job, job.finish(raws)))
            except Exception as exc:
                log.exception("finishing a request failed")
                outcomes.append((job, exc))
        self._call_in_loop(settle, outcomes)

    def _engine_died(self, engine: int) -> None:
        log.error("engine process %d died", self.engines[engine].pid)
        self.dead.add(engine)
        with self._lock:
            lost = [key for key, sent in self._sent.items() if sent.engine == engine]
            outcomes: list[tuple[Job, object]] = [
                (self._sent.pop(key).job, engine_dead()) for key in lost
            ]
        self._call_in_loop(settle, outcomes)
        if self.on_engine_dead is not None:
            self._call_in_loop(self.on_engine_dead, engine)

    def _call_in_loop(self, callback: Callable[..., None], *args: object) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop closed at shutdown: nobody waits
            self._loop.call_soon_threadsafe(callback, *args)
