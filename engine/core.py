"""The engine process's core: every front end's jobs go into one batching queue per model.

Front ends push `Submit` messages (token ids as raw arrays) to one PULL socket, which a
receiver thread reads and enqueues; the queues batch across all front ends; each batch's
finished jobs go back to their front ends as raw float32 outputs, one message per front end
per batch, sent from the forward worker that computed them. So a call's path through this
process is threads handing over under locks, with no event-loop turn on it (three turns and
a ZMQ poll on the loop cost about 0.7 ms of a C=1 call's 13). A `Cancel` drops a job's
queued items. Deadlines and the queue bound are enforced here, as in-process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Sequence

import numpy as np
import zmq

from engine.batch_queue import BatchConfig, BatchQueue
from engine.engine_client import LocalEngineClient
from engine.ipc import (
    IDS,
    OUTPUTS,
    Cancel,
    ErrorInfo,
    JobResult,
    Results,
    Submit,
    encoder,
    to_engine_decoder,
)
from engine.jobs import Job
from engine.tokenization import TokenSequence

log = logging.getLogger(__name__)

POLL_MS = 200  # how often the receiver looks up from an idle socket, to notice stop()


def _raws(raws: list[np.ndarray]) -> list[np.ndarray]:
    """An engine process returns raw outputs: heads run in the front end."""
    return raws


class EngineCore:
    def __init__(self, models: Sequence[object], config: BatchConfig, address: str) -> None:
        """`models`: LoadedModels; `address`: where front ends send jobs (a ZMQ endpoint)."""
        self.client = LocalEngineClient(models, config)  # type: ignore[arg-type]
        self.address = address
        self._context = zmq.Context()
        self._replies: dict[str, zmq.Socket[bytes]] = {}
        self._send_lock = threading.Lock()  # the reply sockets, used by every worker
        # Jobs not yet answered, by (front end, id): whoever pops one answers (or drops) it.
        self._jobs: dict[tuple[str, int], Job] = {}
        self._reply_to: dict[int, str] = {}  # a front end's origin: its reply address
        self._stopping = False
        self._receiver = threading.Thread(target=self._receive, name="engine-jobs", daemon=True)

    @property
    def queues(self) -> dict[str, BatchQueue]:
        return self.client.queues

    async def start(self) -> None:
        """Load the queues (warming every model) and bind; front ends may then connect."""
        await self.client.start()
        self._loop = asyncio.get_running_loop()
        for queue in self.queues.values():
            queue.deliver = self._send
        self._jobs_in = self._context.socket(zmq.PULL)
        self._jobs_in.setsockopt(zmq.RCVHWM, 0)
        self._jobs_in.setsockopt(zmq.RCVTIMEO, POLL_MS)
        self._jobs_in.bind(self.address)

    async def serve(self) -> None:
        """Take messages (on the receiver thread) until cancelled."""
        self._receiver.start()
        await self._loop.create_future()

    async def stop(self) -> None:
        self._stopping = True
        if self._receiver.is_alive():
            await asyncio.to_thread(self._receiver.join)
        await self.client.stop()
        self._context.destroy(linger=0)

    def _receive(self) -> None:
        while not self._stopping:
            try:
                frames = self._jobs_in.recv_multipart(copy=False)
            except zmq.Again:
                continue
            try:
                message = to_engine_decoder.decode(frames[0].buffer)
                if isinstance(message, Cancel):
                    self._loop.call_soon_threadsafe(self._cancel, message)
                else:
                    self._submit(message, frames[1:])
            except Exception:  # a bad message must not stop the engine for everyone
                log.exception("dropped a message the engine could not read")

    def _submit(self, message: Submit, frames: Sequence[zmq.Frame]) -> None:
        """On the receiver thread: the message's jobs into their models' queues."""
        ids = np.frombuffer(frames[0].buffer, dtype=IDS)
        types = np.frombuffer(frames[1].buffer, dtype=IDS) if message.with_types else None
        self._reply_to[message.origin] = message.reply_to
        by_model: dict[str, list[Job]] = {}
        offset = 0
        for header in message.jobs:
            work = []
            for n in header.lengths:
                end = offset + n
                token_types = None if types is None else types[offset:end]
                work.append(
                    (TokenSequence(ids[offset:end], token_types, [], []), header.keep_tokens)
                )
                offset = end
            job = Job(
                work,
                _raws,
                self._loop.create_future(),  # cancelled on the loop; nothing awaits it
                header.deadline,
                origin=message.origin,  # with the client, (origin, client) is the queue's key
                client=header.client,
                key=header.id,
            )
            self._jobs[message.reply_to, header.id] = job
            by_model.setdefault(header.model, []).append(job)
        refused: list[tuple[Job, object]] = []
        for model, jobs in by_model.items():
            if model not in self.queues:  # front ends know the same models: a bug if not
                log.error("jobs for unknown model %r from %s", model, message.reply_to)
                refused += [(job, KeyError(model)) for job in jobs]
            else:
                refused += self.client.submit(model, jobs)
        if refused:
            self._send(refused)

    def _cancel(self, message: Cancel) -> None:
        """On the loop: a cancelled job's queued items are dropped; nothing is sent back."""
        for key in message.ids:
            job = self._jobs.pop((message.reply_to, key), None)
            if job is not None:
                job.future.cancel()

    def _send(self, outcomes: Sequence[tuple[Job, object]]) -> None:
        """On any thread: each outcome (raw outputs or an error) to its front end, in one
        message per front end."""
        by_front_end: dict[str, list[tuple[Job, object]]] = {}
        for job, outcome in outcomes:
            reply_to = self._reply_to[job.origin]
            if self._jobs.pop((reply_to, job.key), None) is not None:  # else cancelled
                by_front_end.setdefault(reply_to, []).append((job, outcome))
        for reply_to, answered in by_front_end.items():
            frames = _frames(answered)
            with self._send_lock, contextlib.suppress(zmq.Again):  # zmq.Again: it is gone
                self._reply_socket(reply_to).send_multipart(frames, copy=False, flags=zmq.NOBLOCK)

    def _reply_socket(self, address: str) -> zmq.Socket[bytes]:
        sock = self._replies.get(address)
        if sock is None:
            sock = self._replies[address] = self._context.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)  # a live front end gets every result
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
        return sock


def _frames(answered: Sequence[tuple[Job, object]]) -> list[object]:
    """A `Results` header and every answer's outputs as one float32 buffer."""
    results, arrays = [], []
    for job, outcome in answered:
        timing = job.timing
        if isinstance(outcome, BaseException):
            shapes, info = [], ErrorInfo.of(outcome)
        else:
            raws: list[np.ndarray] = outcome  # type: ignore[assignment]
            shapes = [list(raw.shape) for raw in raws]
            arrays += [np.asarray(raw, dtype=OUTPUTS).reshape(-1) for raw in raws]
            info = None
        results.append(
            JobResult(job.key, shapes, info, timing.enqueued, timing.started, timing.finished)
        )
    data = np.concatenate(arrays) if arrays else np.empty(0, OUTPUTS)
    return [encoder.encode(Results(results)), data]
