"""The engine process's core: every front end's jobs go into one batching queue per model.

Front ends push `Submit` messages (token ids as raw arrays) to one PULL socket; the queues
batch across all of them; each batch's finished jobs go back to their front ends as raw
float32 outputs, one message per front end per event-loop turn. A `Cancel` drops a job's
queued items. Deadlines and the queue bound are enforced here, as in-process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

import numpy as np
import zmq
import zmq.asyncio

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


def _raws(raws: list[np.ndarray]) -> list[np.ndarray]:
    """An engine process returns raw outputs: heads run in the front end."""
    return raws


class EngineCore:
    def __init__(self, models: Sequence[object], config: BatchConfig, address: str) -> None:
        """`models`: LoadedModels; `address`: where front ends send jobs (a ZMQ endpoint)."""
        self.client = LocalEngineClient(models, config)  # type: ignore[arg-type]
        self.address = address
        self._context = zmq.asyncio.Context()
        self._reply_context = zmq.Context()  # plain sockets: sends from callbacks never wait
        self._replies: dict[str, zmq.Socket[bytes]] = {}
        self._jobs: dict[tuple[str, int], Job] = {}
        self._outbox: dict[str, list[tuple[Job, BaseException | None]]] = {}

    @property
    def queues(self) -> dict[str, BatchQueue]:
        return self.client.queues

    async def start(self) -> None:
        """Load the queues (warming every model) and bind; front ends may then connect."""
        await self.client.start()
        self._jobs_in = self._context.socket(zmq.PULL)
        self._jobs_in.setsockopt(zmq.RCVHWM, 0)
        self._jobs_in.bind(self.address)

    async def serve(self) -> None:
        """Take messages until cancelled."""
        while True:
            frames = await self._jobs_in.recv_multipart(copy=False)
            try:
                message = to_engine_decoder.decode(frames[0].buffer)
                if isinstance(message, Cancel):
                    self._cancel(message)
                else:
                    self._submit(message, frames[1:])
            except Exception:  # a bad message must not stop the engine for everyone
                log.exception("dropped a message the engine could not read")

    async def stop(self) -> None:
        await self.client.stop()
        self._context.destroy(linger=0)
        self._reply_context.destroy(linger=0)

    def _submit(self, message: Submit, frames: Sequence[zmq.Frame]) -> None:
        loop = asyncio.get_running_loop()
        ids = np.frombuffer(frames[0].buffer, dtype=IDS)
        types = np.frombuffer(frames[1].buffer, dtype=IDS) if message.with_types else None
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
            future: asyncio.Future[object] = loop.create_future()
            job = Job(
                work,
                _raws,
                future,
                header.deadline,
                origin=message.origin,  # with the client, (origin, client) is the queue's key
                client=header.client,
                key=header.id,
            )
            self._jobs[message.reply_to, header.id] = job
            future.add_done_callback(lambda _f, to=message.reply_to, j=job: self._done(to, j))
            by_model.setdefault(header.model, []).append(job)
        for model, jobs in by_model.items():
            if model not in self.queues:  # front ends know the same models: a bug if not
                log.error("jobs for unknown model %r from %s", model, message.reply_to)
                refused = [(job, KeyError(model)) for job in jobs]
            else:
                refused = self.client.submit(model, jobs)  # type: ignore[assignment]
            for job, error in refused:
                job.future.set_exception(error)

    def _cancel(self, message: Cancel) -> None:
        for key in message.ids:
            job = self._jobs.get((message.reply_to, key))
            if job is not None:
                job.future.cancel()  # the queue drops its items; nothing is sent back

    def _done(self, reply_to: str, job: Job) -> None:
        self._jobs.pop((reply_to, job.key), None)
        if job.future.cancelled():
            return
        outbox = self._outbox.setdefault(reply_to, [])
        if not outbox:  # the first result for this front end this turn: send after the rest
            asyncio.get_running_loop().call_soon(self._flush, reply_to)
        outbox.append((job, job.future.exception()))

    def _flush(self, reply_to: str) -> None:
        results, arrays = [], []
        for job, error in self._outbox.pop(reply_to, []):
            timing = job.timing
            if error is None:
                raws: list[np.ndarray] = job.future.result()
                shapes = [list(raw.shape) for raw in raws]
                arrays += [np.asarray(raw, dtype=OUTPUTS).reshape(-1) for raw in raws]
                info = None
            else:
                shapes, info = [], ErrorInfo.of(error)
            results.append(
                JobResult(job.key, shapes, info, timing.enqueued, timing.started, timing.finished)
            )
        data = np.concatenate(arrays) if arrays else np.empty(0, OUTPUTS)
        frames = [encoder.encode(Results(results)), data]
        with contextlib.suppress(zmq.Again):  # the front end is gone
            self._reply_socket(reply_to).send_multipart(frames, copy=False, flags=zmq.NOBLOCK)

    def _reply_socket(self, address: str) -> zmq.Socket[bytes]:
        sock = self._replies.get(address)
        if sock is None:
            sock = self._replies[address] = self._reply_context.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)  # a live front end gets every result
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
        return sock
