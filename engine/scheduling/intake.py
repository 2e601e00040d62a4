"""The engine's intake: the tokenizer threads between the event loop and the batching queues.

A validated request is put on a lane; a tokenizer thread takes every request waiting on
its lane, plans each (tokenizes, checks lengths, decodes images), and queues the jobs with
one lock and one wake-up per model. Three kinds of lane keep slow work from holding up
small calls: the tokenize threads for ordinary requests, one thread for requests with
images or audio (decoded one at a time), and one for large requests (BULK_SIZE).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from queue import Empty, SimpleQueue
from typing import TYPE_CHECKING

import numpy as np

from pooling_server.engine.caching.key import request_tag
from pooling_server.engine.errors import PoolingError
from pooling_server.engine.models.served import ServedModel
from pooling_server.engine.requests.outputs import PoolResult
from pooling_server.engine.requests.plans import Plan, plan_request
from pooling_server.engine.requests.request import PoolRequest, has_media
from pooling_server.engine.requests.resolved import Limits, Resolved
from pooling_server.engine.scheduling.engine_client import EngineClient
from pooling_server.engine.scheduling.jobs import Job, settle

if TYPE_CHECKING:
    from pooling_server.engine.scheduling.engine import Timings

# Requests one tokenizer thread takes at once: enough to queue a batch with one wake-up.
INTAKE_BATCH = 64
# A request whose texts (characters, plus this much per input) pass BULK_SIZE is tokenized
# on the bulk thread: 1,024 documents of a ColBERT's 512 tokens took the one tokenizer
# thread seconds, and every small call waited behind it (issue 43, row 8).
BULK_PER_INPUT = 32
BULK_SIZE = 1 << 16
# Large requests tokenized and not yet answered, at most: each holds its token lists (a
# 1,024-document rerank of 512 tokens each, ~130 MB of them) until answered, and three at
# once grew a front end by 400 MB. The next one waits its turn on the bulk thread; the
# engine is busy with the one in flight meanwhile, so little throughput is lost.
BULK_IN_FLIGHT = 1


@dataclass(slots=True)
class Entry:
    """A validated request on its way to a tokenizer thread, then its job once queued."""

    request: Resolved
    model: ServedModel
    deadline: float | None
    timings: Timings
    future: asyncio.Future[PoolResult]
    started: float
    client: str
    job: Job | None = None


class Intake:
    """The lanes and their tokenizer threads (--tokenizer-threads of them for ordinary
    requests, plus the media and bulk threads), planning into `client`'s queues."""

    def __init__(
        self,
        limits: Limits,
        client: EngineClient,
        tokenizer_threads: int,
        media: bool,
        caching: bool = False,
    ) -> None:
        """`caching`: the result cache is on, so each job carries its request's tag."""
        self.limits = limits
        self.client = client
        self.caching = caching
        # Requests to tokenize and queue; each thread has its own tokenizer (ModelTokenizer).
        self._ordinary: SimpleQueue[Entry | None] = SimpleQueue()
        self.threads = [
            self._thread(self._ordinary, f"tokenize-{k}") for k in range(max(1, tokenizer_threads))
        ]
        # Requests with images (or audio clips) take turns on a thread of their own, one
        # decoded at a time: a decode of tens of megapixels neither holds up the texts
        # behind it nor multiplies its memory by the requests that send one at once.
        self._pictures: SimpleQueue[Entry | None] = SimpleQueue()
        if media:
            self.threads.append(self._thread(self._pictures, "images"))
        # Large requests take turns on a thread of their own, so that tokenizing one (seconds
        # for a thousand long documents) never holds the small calls behind it; the GIL is
        # shared, but the tokenizer's Rust releases it, and Python switches threads every 5 ms.
        self._bulk: SimpleQueue[Entry | None] = SimpleQueue()
        self._bulk_slots = threading.Semaphore(BULK_IN_FLIGHT)
        self._stopping = False
        self.threads.append(self._thread(self._bulk, "bulk"))

    def _thread(self, lane: SimpleQueue[Entry | None], name: str) -> threading.Thread:
        return threading.Thread(
            target=self._tokenize_and_queue, args=(lane,), name=name, daemon=True
        )

    def add_media_lane(self) -> None:
        """Start the media thread for a model loaded at run time, unless one runs."""
        if not any(thread.name == "images" for thread in self.threads):
            lane = self._thread(self._pictures, "images")
            self.threads.append(lane)
            lane.start()

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    async def stop(self) -> None:
        self._stopping = True
        for thread in self.threads:
            self._lane(thread.name).put(None)
        for thread in self.threads:
            if thread.is_alive():
                await asyncio.to_thread(thread.join)

    def put(self, entry: Entry) -> None:
        """Queue a request on its lane: media, bulk (by its size) or ordinary."""
        request = entry.request.request
        if entry.model.info.accepts_media and has_media(request):
            self._pictures.put(entry)
        elif _size(request) > BULK_SIZE:
            self._bulk.put(entry)
        else:
            self._ordinary.put(entry)

    def _lane(self, thread: str) -> SimpleQueue[Entry | None]:
        """The intake a tokenizer thread (by its name) takes its requests from."""
        if thread == "images":
            return self._pictures
        return self._bulk if thread == "bulk" else self._ordinary

    def _tokenize_and_queue(self, intake: SimpleQueue[Entry | None]) -> None:
        """A tokenizer thread: take every request waiting, plan each (tokenize, check
        lengths; decode images), then queue the jobs with one lock and one wake-up per model."""
        bulk = intake is self._bulk
        while True:
            entries = _take_intake(intake, 1 if bulk else INTAKE_BATCH)
            stopping = None in entries
            self._plan_and_queue(entries, bulk)
            # Not kept until the next request comes: each entry holds its job, and so its
            # token lists (a large request's, 100 MB and more, held while the server idles).
            entries = []
            if stopping:
                return

    def _plan_and_queue(self, entries: list[Entry | None], bulk: bool) -> None:
        """Plan each request taken (tokenize, check lengths; decode images), then queue the
        jobs with one lock and one wake-up per model; fail the ones refused."""
        jobs: dict[str, list[Job]] = {}
        failed: list[tuple[Job | Entry, BaseException]] = []
        for entry in entries:
            if entry is None or entry.future.done():  # stopping, or the caller went away
                continue
            if bulk and not self._bulk_slot(entry):
                continue
            try:
                request, model = entry.request, entry.model
                plan = plan_request(request, model, self.limits)  # tokenized here
                entry.timings.tokenize_s = time.monotonic() - entry.started
                finish = _finisher(request, model, plan)
                batches = entry.timings.batches
                job = entry.job = Job(
                    plan.work,
                    finish,
                    entry.future,
                    entry.deadline,
                    batches,
                    client=entry.client,
                    fold=plan.fold,
                    adapter=request.request.adapter,
                )
                if self.caching and not request.request.bypass_cache:
                    job.cache = request_tag(request, request.request.cache_scope)
                jobs.setdefault(model.info.name, []).append(job)
            except PoolingError as exc:  # the request's own error: no traceback kept,
                # which would hold this thread's frame, and `failed` with the error in it
                failed.append((entry, exc.with_traceback(None)))
            except Exception as exc:  # a bug: the caller hears it
                failed.append((entry, exc))
        for name, queued in jobs.items():
            failed += self.client.submit(name, queued)
        if failed:
            loop = failed[0][0].future.get_loop()
            with contextlib.suppress(RuntimeError):  # the loop closed at shutdown
                loop.call_soon_threadsafe(settle, failed)

    def _bulk_slot(self, entry: Entry) -> bool:
        """On the bulk thread: wait for a large request's turn (BULK_IN_FLIGHT), given back
        when its future is done, however (answered, failed, cancelled); False if its caller
        went away meanwhile (the turn is passed on)."""
        while not self._bulk_slots.acquire(timeout=0.5):
            if self._stopping or entry.future.done():
                return False
        future = entry.future
        release = self._bulk_slots.release
        try:
            future.get_loop().call_soon_threadsafe(future.add_done_callback, lambda _: release())
        except RuntimeError:  # the loop closed at shutdown
            release()
            return False
        return not future.done()


def _finisher(resolved: Resolved, model: ServedModel, plan: Plan) -> Callable[..., PoolResult]:
    """Raw outputs to the request's result (heads included), run where the last batch ran."""
    name, tokens, request = model.info.name, plan.prompt_tokens, resolved.request

    def finish(raws: list[np.ndarray]) -> PoolResult:
        return PoolResult(request.request_id, name, request.task, tokens, plan.finish(raws))

    return finish


def _size(request: PoolRequest) -> int:
    """What tokenizing a request costs, roughly: its texts' characters, and a little per
    input (a request of many short texts costs per text too)."""
    size = 0
    for texts in (request.texts, request.text_1, request.text_2, request.candidate_labels):
        size += sum(map(len, texts)) + BULK_PER_INPUT * len(texts)
    for items in (request.items, request.items_1, request.items_2):
        size += sum(len(item) if isinstance(item, str) else 0 for item in items)
        size += BULK_PER_INPUT * len(items)
    return size


def _take_intake(intake: SimpleQueue[Entry | None], bound: int) -> list[Entry | None]:
    """Block for one request, then take the others already waiting (up to `bound`)."""
    entries = [intake.get()]
    while entries[-1] is not None and len(entries) < bound:
        try:
            entries.append(intake.get_nowait())
        except Empty:
            break
    return entries
