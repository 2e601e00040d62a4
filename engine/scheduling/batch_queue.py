"""Per-model batching queue: requests' sequences wait as items; worker threads form batches.

A request enters as a `Job`: its sequences, the function that turns their raw outputs into
its result, and one asyncio future. Jobs are enqueued from any thread (the engine's
tokenizer threads). The model's worker threads take the next batch the moment their
previous forward pass ends, finish every job the batch completes (heads included), and hand
the results to the event loop in one call per batch, so the loop only resolves futures (an
engine process takes them on the worker thread instead, see `deliver`). With two workers
one batch is collated (and copied to the GPU) while the other computes; on a CPU, two
workers of one intra-op thread each get more from the cores than one worker of two threads,
whose parallel regions stall whenever the event loop takes a core. A batch is built around
an anchor item from the items closest to it in length, within a budget of padded tokens
(longest x count), a cap on items and a minimum share of real (non-padding) tokens.

Items wait per client (a front end's connection or address, see `Job.client`), so one
client cannot take the queue from the others: each may hold at most
`max_queued_items_per_client` items, and when several clients wait the anchor's client
goes round robin (the one whose turn is longest past anchors next, on its oldest item),
while the items around it come from every waiting client in turn, closest in length first.
A client that had nothing queued anchors next, after the others that came so: a small call
beside clients with long backlogs waits for the batches already running, not for one batch
of each backlog (issue 43: three reranks of 1,024 documents held one 7 s). A client that
keeps a backlog gains nothing by it: it came once, and takes its turns after that.
With one client waiting this is the oldest-first batching above, unchanged.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING

import numpy as np

from pooling_server.engine.errors import ErrorKind, PoolingError
from pooling_server.engine.inputs.modality import Frame
from pooling_server.engine.inputs.tokenization import TokenSequence
from pooling_server.engine.scheduling.jobs import Job, Partial, settle

if TYPE_CHECKING:  # the runner's torch is needed only where a model runs
    from pooling_server.engine.caching.flights import ModelCache
    from pooling_server.engine.models.model_runner import ModelRunner

log = logging.getLogger(__name__)


# Who queued an item: (front end, client). The front end's index keeps two front ends'
# peers apart; client "" (a caller that names none, e.g. the engine used as a library) is
# not held to the per-client bound, but still takes its turn.
ClientKey = tuple[int, str]

DEFAULT_CLIENT_FLOOR = 1024  # the default --max-client-batch-size: one largest request


def default_client_cap(max_queued_items: int, largest_request: int = DEFAULT_CLIENT_FLOOR) -> int:
    """A quarter of the queue, so at least four clients fit, but never less than one largest
    request (or it would be refused forever) unless the whole queue is smaller."""
    return max(max_queued_items // 4, min(max_queued_items, largest_request))


@dataclass(frozen=True)
class BatchConfig:
    max_batch_tokens: int = 16384
    max_batch_size: int = 32  # 0: chosen by the server for the device
    workers: int = 1  # forward-pass threads sharing the model; 0: chosen by the server
    batch_wait_s: float = 0.0
    max_queued_items: int = 100_000
    # Items one client may have queued (see ClientKey); 0: default_client_cap().
    max_queued_items_per_client: int = 0
    # A batch grows only while real tokens / padded tokens stays above this, so every
    # batch, and the whole stream, wastes at most 10% on padding (issue 35's target).
    min_padding_efficiency: float = 0.9
    # How many of the oldest items a scheduling step looks at; bounds its cost. A step
    # touches every item of its window several times (the slices, their lengths, the
    # rebuilt queue), which an engine pays per batch: halving it from 2048 cut an engine's
    # CPU per item by 12-25% at 256-item batches (benchmarks/engine_alone.py). Four of a
    # GPU's batches still find texts of like length.
    lookahead: int = 1024

    @property
    def client_cap(self) -> int:
        """The per-client bound in items, with the default filled in."""
        return self.max_queued_items_per_client or default_client_cap(self.max_queued_items)


@dataclass(eq=False, slots=True)
class QueuedItem:
    sequence: TokenSequence
    keep_tokens: bool
    job: Job
    index: int  # in job.work
    enqueued: float
    length: int  # len(sequence), read for every item of the window at each batch


@dataclass(eq=False, slots=True)
class CachedItem(QueuedItem):
    """An item the result cache missed, queued under its key: its output is kept, and
    answers the requests that joined its flight meanwhile (engine/caching/flights.py)."""

    key: bytes = b""


_length = attrgetter("length")
_job = attrgetter("job")


@dataclass
class QueueStats:
    """Counters for metrics and tests."""

    batches: int = 0
    items_computed: int = 0
    tokens_computed: int = 0
    padded_tokens_computed: int = 0
    dropped_cancelled: int = 0
    dropped_expired: int = 0
    failed_batches: int = 0
    mixed_batches: int = 0  # batches holding jobs of more than one front end


@dataclass(frozen=True)
class QueueLoad:
    """What `BatchQueue.load` counted: items waiting, requests waiting, requests under way."""

    items: int
    queued_requests: int
    running_requests: int


@dataclass(frozen=True)
class BatchRecord:
    """What one finished batch looked like, for observers (metrics, tracing)."""

    size: int
    tokens: int
    padded_tokens: int
    queue_wait_s: Sequence[float]
    forward_s: float
    error: BaseException | None
    origins: int = 1  # how many front ends' jobs the batch held


class BatchQueue:
    def __init__(self, runner: ModelRunner, config: BatchConfig) -> None:
        self.runner = runner
        self.config = config
        self.stats = QueueStats()
        self.observers: list[Callable[[str, BatchRecord], None]] = []
        # Set by an engine process: takes each batch's outcomes on the worker thread and
        # sends them to the front ends from there, so no event-loop turn lies on a call's
        # path; their futures are then left unresolved (nothing awaits them).
        self.deliver: Callable[[list[tuple[Job, object]]], None] | None = None
        # The result cache (--cache-mb, --cache-redis), this model's view of it; None: off,
        # and no step below does any work for it.
        self.cache: ModelCache | None = None
        # Each client's items, oldest first; the clients in turn order (the next anchor first).
        self._pending: dict[ClientKey, list[QueuedItem]] = {}
        # Clients that came with nothing queued and have not anchored since, in arrival
        # order: they go ahead of the others' turns (see _promote).
        self._ahead: list[ClientKey] = []
        self._size = 0  # items in _pending
        # Set by an owner that calls `cancelled()` whenever it cancels a job's future (an
        # engine process): the queue then walks its items for dead ones only after a
        # cancel, a failed batch or a deadline passing, not before every batch (that walk
        # cost ~1.5 us an item at 4096 queued). In-process, callers cancel futures unseen.
        self.told_of_cancels = False
        self._maybe_dead = False  # a job failed or was cancelled since the last walk
        self._next_deadline = math.inf  # no queued item's deadline is earlier
        self._lock = threading.RLock()
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._workers = [
            threading.Thread(
                target=self._work, args=(k,), name=f"forward-{runner.info.name}-{k}", daemon=True
            )
            for k in range(max(1, config.workers))
        ]
        # One condition per worker over the one lock, so that only a worker that may take a
        # batch is woken (see _wake_eligible).
        self._wakes = [threading.Condition(self._lock) for _ in self._workers]
        self._warmed = [concurrent.futures.Future[None]() for _ in self._workers]
        self._busy = [False] * len(self._workers)
        self._computing: list[list[QueuedItem]] = [[] for _ in self._workers]  # for load()
        # A two-tower model's batches hold one tower's items: texts or images (Frame,
        # whose length is its patch count), never both.
        self._towers = getattr(runner.info, "towers", None) is not None

    @property
    def depth(self) -> int:
        """Items waiting for a batch whose caller still waits (cancelled ones do not count).

        Counted when read (a scrape, a full queue) rather than kept up to date per item.
        """
        with self._lock:
            return sum(not item.job.dead for items in self._pending.values() for item in items)

    def load(self) -> QueueLoad:
        """Items and requests waiting, and requests under way, counted when read (a scrape)
        under the lock, as `depth` is: read-only, for the fleet's gauges.

        A request (job) is under way once any of its items is in a forward pass or was
        computed, until it is answered; it is queued while all its items still wait.
        """
        with self._lock:
            running = {item.job for batch in self._computing for item in batch}
            queued: set[Job] = set()
            items = 0
            for pending in self._pending.values():
                # Counted per job in C, then each job looked at once: a quarter of the cost
                # of looking at every item (~30 ms at 100,000 queued on a busy core).
                for job, count in Counter(map(_job, pending)).items():
                    if job.dead:
                        continue
                    items += count
                    if job in running or job.remaining < len(job.work):
                        running.add(job)
                    else:
                        queued.add(job)
            running = {job for job in running if not job.dead}
            return QueueLoad(items, len(queued), len(running))

    @property
    def empty(self) -> bool:
        """Nothing queued at all, without counting (cheap enough for every batch)."""
        return not self._pending

    def _has_room(self, count: int) -> bool:
        """Recount only near the bound: cancelled items stay queued until a batch drops them."""
        bound = self.config.max_queued_items
        return self._size + count <= bound or self.depth + count <= bound

    def _client_room(self, queued: list[QueuedItem] | None, count: int, cap: int) -> int | None:
        """None if a client with `queued` items may add `count`; else its live items."""
        if queued is None or len(queued) + count <= cap:
            return None
        live = sum(not item.job.dead for item in queued)
        return None if live + count <= cap else live

    async def start(self) -> None:
        """Start the workers; returns once each has warmed the model up on its own thread."""
        self._loop = asyncio.get_running_loop()
        for worker in self._workers:
            worker.start()
        await asyncio.gather(*(asyncio.wrap_future(warmed) for warmed in self._warmed))

    async def stop(self) -> None:
        with self._lock:
            self._stopping = True
            for wake in self._wakes:
                wake.notify_all()
        for worker in self._workers:
            await asyncio.to_thread(worker.join)

    def enqueue(self, jobs: Sequence[Job]) -> list[tuple[Job, PoolingError]]:
        """Queue each job's sequences, all or none; returns the jobs refused as QUEUE_FULL.

        Safe from any thread; one call takes the lock and wakes the workers once.
        """
        if self.cache is not None:
            return self._enqueue_cached(jobs)
        return self._enqueue(jobs)

    def _enqueue(self, jobs: Sequence[Job]) -> list[tuple[Job, PoolingError]]:
        now = time.monotonic()
        cap = self.config.client_cap
        refused: list[tuple[Job, PoolingError]] = []
        with self._lock:
            for job in jobs:
                count, key = len(job.work), (job.origin, job.client)
                queued = self._pending.get(key)
                refusal = self._refusal(job, queued, count, cap)
                if refusal is not None:
                    refused.append((job, refusal))
                    continue
                job.timing.enqueued = now
                if queued is None:  # a client with nothing queued anchors next (_promote)
                    queued = self._pending[key] = []
                    self._ahead.append(key)
                if count == 1:  # one text, the usual request: half the cost of the general way
                    [(sequence, keep)] = job.work
                    queued.append(QueuedItem(sequence, keep, job, 0, now, len(sequence)))
                else:
                    queued.extend(
                        QueuedItem(sequence, keep, job, index, now, len(sequence))
                        for index, (sequence, keep) in enumerate(job.work)
                    )
                self._size += count
                if job.deadline is not None and job.deadline < self._next_deadline:
                    self._next_deadline = job.deadline
            self._wake_eligible()
        return refused

    def _refusal(
        self, job: Job, queued: list[QueuedItem] | None, count: int, cap: int
    ) -> PoolingError | None:
        """Why `count` more items of `job` may not queue now, None if they may: past its
        client's share (the heavy client is the one told to back off), or the queue full."""
        live = self._client_room(queued, count, cap) if job.client else None
        if live is not None:
            return self._client_full(live, cap)
        return None if self._has_room(count) else self._full()

    def _enqueue_cached(self, jobs: Sequence[Job]) -> list[tuple[Job, PoolingError]]:
        """`enqueue` with the result cache on: each item is looked up first (a hit never
        enters the queue), an item in flight is joined, and only the rest are queued, each
        opening its flight. A job's room is counted on the items the look-up missed."""
        cache = self.cache
        assert cache is not None
        plain = [job for job in jobs if job.cache is None]  # bypassed
        refused = self._enqueue(plain) if plain else []
        cached = [job for job in jobs if job.cache is not None]
        if not cached:
            return refused
        try:
            keys = [cache.keys(job) for job in cached]
            found = cache.results.find([key for job_keys in keys for key in job_keys])
        except Exception:  # a bug of the cache's: the call goes on without it
            log.exception("the result cache failed a look-up; computing without it")
            return refused + self._enqueue(cached)
        flights, now, cap = cache.flights, time.monotonic(), self.config.client_cap
        outcomes: list[tuple[Job, object]] = []
        misses = shared = offset = 0
        with self._lock:
            for job, job_keys in zip(cached, keys, strict=True):
                values = found[offset : offset + len(job_keys)]
                offset += len(job_keys)
                count = sum(value is None for value in values)
                client = (job.origin, job.client)
                queued = self._pending.get(client)
                if count:
                    refusal = self._refusal(job, queued, count, cap)
                    if refusal is not None:
                        refused.append((job, refusal))
                        continue
                job.timing.enqueued = now
                fresh: list[QueuedItem] = []
                for index, key in enumerate(job_keys):
                    sequence, keep = job.work[index]
                    value = values[index]
                    if value is None:  # landed since the look-up?
                        value = cache.results.recheck(key)
                    if value is not None:
                        try:
                            job.raws[index] = value if job.fold is None else job.fold(index, value)
                        except Exception as exc:
                            log.exception("finishing a request's output failed")
                            job.failed = True
                            outcomes.append((job, exc))
                            break
                        job.remaining -= 1
                        job.cached += len(sequence)
                        continue
                    waiters = flights.get(key)
                    if waiters is not None:
                        waiters.append((job, index))
                        job.cached += len(sequence)
                        shared += 1
                        continue
                    flights[key] = []
                    fresh.append(CachedItem(sequence, keep, job, index, now, len(sequence), key))
                misses += len(fresh)
                if job.remaining == 0 and not job.failed:
                    outcomes.append((job, _hits_only(job)))
                if fresh:
                    if queued is None:
                        queued = self._pending[client] = []
                        self._ahead.append(client)
                    queued.extend(fresh)
                    self._size += len(fresh)
                    if job.deadline is not None and job.deadline < self._next_deadline:
                        self._next_deadline = job.deadline
            if misses:
                self._wake_eligible()
        cache.results.count(misses, shared)
        finished = []
        for job, outcome in outcomes:  # every item a hit: heads and results, off the lock
            if outcome is job:
                try:
                    outcome = job.finish(job.raws)
                except Exception as exc:
                    log.exception("finishing a request failed")
                    outcome = exc
            finished.append((job, outcome))
        if finished:
            self._hand_over(finished, None)
        return refused

    def _land_flights(
        self, batch: list[QueuedItem], outputs: list[np.ndarray] | None
    ) -> list[tuple[Job, int, np.ndarray | None]]:
        """With the cache on, as a batch ends: each missed item's output kept (before its
        flight closes, so a request coming meanwhile finds one or the other), and the
        waiters of its flight, with the output each gets (folded; None: the pass failed)."""
        cache = self.cache
        assert cache is not None
        keyed = [(pos, item.key) for pos, item in enumerate(batch) if type(item) is CachedItem]
        if not keyed:
            return []
        kept: list[np.ndarray | None] = [None] * len(keyed)
        if outputs is not None:
            try:
                kept = [cache.store(key, outputs[pos]) for pos, key in keyed]
            except Exception:  # a bug of the cache's: the waiters still get the outputs
                log.exception("the result cache failed to keep a batch's outputs")
                kept = [outputs[pos] for pos, _ in keyed]
        landed: list[tuple[Job, int, np.ndarray | None]] = []
        with self._lock:
            for (_, key), value in zip(keyed, kept, strict=True):
                landed += [(job, index, value) for job, index in cache.flights.pop(key, ())]
        for n, (job, index, value) in enumerate(landed):
            if value is not None and job.fold is not None and not job.dead:
                try:
                    landed[n] = (job, index, job.fold(index, value))
                except Exception:
                    log.exception("finishing a request's output failed")
                    job.failed = True
        return landed

    def _take_outputs(
        self,
        landed: Iterable[tuple[Job, int, np.ndarray | None]],
        times: tuple[float, float],
        error: BaseException | None,
        parts: dict[Job, Partial],
        completed: list[Job],
        outcomes: list[tuple[Job, object]],
    ) -> None:
        """Under the lock: each (job, index, output) taken by its job, the batch's own items
        and a flight's waiters alike; None, the pass failed: its job fails (and its other
        items, if queued, are dropped)."""
        for job, index, value in landed:
            job.timing.add_batch(*times)
            if job.failed:
                continue
            if value is None:
                job.failed = True
                self._maybe_dead = True
                outcomes.append((job, _forward_error(error)))
                continue
            if job.streams:
                part = parts.get(job)
                if part is None:
                    part = parts[job] = Partial()
                part.indices.append(index)
                part.raws.append(value)
            else:
                job.raws[index] = value
            job.remaining -= 1
            if job.remaining == 0:
                completed.append(job)

    def _rehome(self, orphans: list[QueuedItem], now: float) -> None:
        """Under the lock: flights whose owner was dropped (cancelled, expired) pass to a
        waiter still waiting, whose item is queued in its place; with none, they close."""
        assert self.cache is not None
        flights = self.cache.flights
        for item in orphans:
            waiters = flights.get(item.key)  # type: ignore[attr-defined]
            if waiters is None:
                continue
            while waiters:
                job, index = waiters.pop(0)
                if job.dead or (job.deadline is not None and now >= job.deadline):
                    continue
                key: bytes = item.key  # type: ignore[attr-defined]
                heir = CachedItem(
                    item.sequence, item.keep_tokens, job, index, now, item.length, key
                )
                job.cached -= item.length  # it computes it now
                client = (job.origin, job.client)
                queued = self._pending.get(client)
                if queued is None:
                    queued = self._pending[client] = []
                    self._ahead.append(client)
                queued.append(heir)
                self._size += 1
                if job.deadline is not None and job.deadline < self._next_deadline:
                    self._next_deadline = job.deadline
                break
            else:
                del flights[item.key]  # type: ignore[attr-defined]

    def _wake_eligible(self) -> None:
        """Wake the workers that may take a batch now (under the lock). Waking every worker
        on each enqueue cost a lone call the second worker's wake-up and GIL turn (45-76 us
        of CPU a call at C=1), for a predicate that kept it waiting."""
        for index, wake in enumerate(self._wakes):
            if self._may_take(index):
                wake.notify()

    def _full(self) -> PoolingError:
        return PoolingError(
            ErrorKind.RESOURCE_EXHAUSTED,
            "QUEUE_FULL",
            f"the queue of model {self.runner.info.name} is full "
            f"({self.config.max_queued_items} items); retry later",
            retry_after_s=1.0,
        )

    def _client_full(self, live: int, cap: int) -> PoolingError:
        return PoolingError(
            ErrorKind.RESOURCE_EXHAUSTED,
            "QUEUE_FULL",
            f"this client already has {live} items queued for model {self.runner.info.name}, "
            f"and one client may have at most {cap} (--max-queued-items-per-client); "
            "retry later",
            metadata={"max_queued_items_per_client": str(cap)},
            retry_after_s=1.0,
        )

    def cancelled(self) -> None:
        """Some job's future was cancelled: the next batch step looks for dead items (see
        `told_of_cancels`)."""
        with self._lock:
            self._maybe_dead = True

    def _drop_dead(self) -> list[Job]:
        """Remove the items nobody waits for; fail and return the jobs past their deadline.

        Each client's items are checked in one comprehension; only a client with items to
        drop is walked again, to count them and fail the expired jobs. When told of every
        cancel, the walk is skipped while no job failed or was cancelled since the last one
        and no queued item's deadline has passed.
        """
        now = time.monotonic()
        if self.told_of_cancels:
            if not self._maybe_dead and now < self._next_deadline:
                return []
            self._maybe_dead = False  # before the walk: a cancel during it sets it again
        expired: list[Job] = []
        orphans: list[QueuedItem] = []
        for key, items in list(self._pending.items()):
            alive = [
                item
                for item in items
                if not (
                    (job := item.job).failed
                    or job.future.done()
                    or (job.deadline is not None and now >= job.deadline)
                )
            ]
            if len(alive) == len(items):
                continue
            if self.cache is not None and self.cache.flights:
                kept = set(map(id, alive))
                orphans += [i for i in items if type(i) is CachedItem and id(i) not in kept]
            self._count_dropped(items, now, expired)
            self._size -= len(items) - len(alive)
            if alive:
                self._pending[key] = alive  # its turn is kept
            else:
                del self._pending[key]
        if orphans:
            self._rehome(orphans, now)
        if self.told_of_cancels:
            deadlines = [
                job.deadline
                for items in self._pending.values()
                for item in items
                if (job := item.job).deadline is not None
            ]
            self._next_deadline = min(deadlines, default=math.inf)
        return expired

    def _count_dropped(self, items: list[QueuedItem], now: float, expired: list[Job]) -> None:
        for item in items:
            job = item.job
            if job.future.done():
                self.stats.dropped_cancelled += 1
            elif job.deadline is not None and now >= job.deadline:
                self.stats.dropped_expired += 1
                if not job.failed:
                    job.failed = True
                    expired.append(job)
            elif job.failed:  # another of its items failed
                self.stats.dropped_cancelled += 1

    def _take_batch(self) -> list[QueuedItem]:
        """The next client's oldest item, then the items closest to it in length while the
        batch stays dense; that client's turn then passes to the back.

        Anchoring on a client's oldest item means nothing starves: a long text waits only
        for its own client's items queued before it and a batch per other waiting client,
        and is then batched with texts of its own length rather than padded against short
        ones. Ties in length go by depth in each client's queue, then by turn, so a batch
        takes the items of every waiting client in turn.
        """
        if not self._pending:
            return []
        if self._ahead:
            self._promote()
        parts = self._window()
        window: list[QueuedItem] = []
        for _, part in parts:
            window += part
        sizes = np.array([len(part) for _, part in parts])
        lengths = np.fromiter(map(_length, window), dtype=np.int64, count=len(window))
        images = None
        if self._towers:
            kinds = (type(item.sequence) is Frame for item in window)
            images = np.fromiter(kinds, dtype=bool, count=len(window))
        chosen = self._choose(lengths, sizes, images)
        batch = [window[i] for i in chosen]
        keep = np.ones(len(window), dtype=bool)
        keep[chosen] = False
        starts = np.cumsum(sizes) - sizes
        # Only the clients that gave items: their oldest items lose the chosen ones.
        givers = np.bincount(
            np.searchsorted(starts, chosen, side="right") - 1, minlength=len(parts)
        )
        for turn in np.flatnonzero(givers).tolist():
            key, part = parts[turn]
            start = int(starts[turn])
            queue = self._pending[key]
            queue[: len(part)] = itertools.compress(part, keep[start : start + len(part)].tolist())
            if not queue:
                del self._pending[key]
        anchor = parts[0][0]
        if self._ahead and self._ahead[0] == anchor:
            del self._ahead[0]
        if anchor in self._pending and len(self._pending) > 1:  # its turn passes to the back
            self._pending[anchor] = self._pending.pop(anchor)
        self._size -= len(batch)
        return batch

    def _promote(self) -> None:
        """Newly come clients (still waiting) to the front of the turns, in arrival order;
        the turns of the others keep their order behind them."""
        ahead = [key for key in self._ahead if key in self._pending]
        self._ahead = ahead
        if ahead and list(itertools.islice(self._pending, len(ahead))) != ahead:
            self._pending = {**dict.fromkeys(ahead), **self._pending}  # type: ignore[dict-item]

    def _choose(
        self, lengths: np.ndarray, sizes: np.ndarray, images: np.ndarray | None = None
    ) -> list[int]:
        """Positions in the window (`lengths`: its items' lengths, the anchor first; `sizes`:
        each client's share, in turn) of the batch, ascending: the anchor, then the others
        by closeness in length, then rank (depth in their client's queue, then turn), each
        kept while the batch stays within the token budget and dense enough.

        In numpy: a Python sort of the window (2048 items) cost ~4 us a batch item. While
        every item in that order is kept, the batch is a prefix of it, found at once; the
        item-by-item rule takes over only from the first one left out.
        """
        config = self.config
        turns = len(sizes)
        owner = np.repeat(np.arange(turns), sizes)
        depth = np.arange(len(lengths)) - np.repeat(np.cumsum(sizes) - sizes, sizes)
        rank = owner + turns * depth  # unique, so the order is total
        distance = np.abs(lengths - lengths[0])
        order = np.argsort(distance * (turns * int(sizes.max())) + rank)  # order[0] == 0
        if images is not None:  # the anchor's tower only
            order = order[images[order] == images[0]]
        ordered = lengths[order]
        longest = np.maximum.accumulate(ordered)
        real = np.cumsum(ordered)
        padded = longest * np.arange(1, len(ordered) + 1)
        fits = (padded <= config.max_batch_tokens) & (
            real >= config.min_padding_efficiency * padded
        )
        fits[0] = True  # the anchor is always taken, whatever the limits
        prefix = int(np.argmin(fits)) if not fits.all() else len(fits)
        prefix = max(1, min(prefix, config.max_batch_size))
        chosen = order[:prefix].tolist()
        if prefix < min(len(order), config.max_batch_size):
            longest_n, real_n = int(longest[prefix - 1]), int(real[prefix - 1])
            for i, n in zip(order[prefix:].tolist(), ordered[prefix:].tolist(), strict=True):
                if len(chosen) >= config.max_batch_size:
                    break
                padded_n = max(longest_n, n) * (len(chosen) + 1)
                if (
                    padded_n > config.max_batch_tokens
                    or real_n + n < config.min_padding_efficiency * padded_n
                ):
                    continue
                chosen.append(i)
                longest_n, real_n = max(longest_n, n), real_n + n
        chosen.sort()
        return chosen

    def _window(self) -> list[tuple[ClientKey, list[QueuedItem]]]:
        """Each client's oldest items, `lookahead` in all (which bounds a step's cost), shared
        out evenly: an equal share each, then what clients with less left over to the
        others in turn. Clients in turn order, the anchor's first; with more clients than
        lookahead, the first `lookahead` in turn."""
        lookahead = self.config.lookahead
        if len(self._pending) == 1:
            [(key, queue)] = self._pending.items()
            return [(key, queue[:lookahead])]
        queues = list(itertools.islice(self._pending.items(), lookahead))
        share = lookahead // len(queues)
        takes = [min(len(queue), share) for _, queue in queues]
        left = lookahead - sum(takes)
        for k, (_, queue) in enumerate(queues):
            if not left:
                break
            more = min(len(queue) - takes[k], left)
            takes[k] += more
            left -= more
        return [(key, queue[:take]) for (key, queue), take in zip(queues, takes, strict=True)]

    def _work(self, index: int) -> None:
        """A worker thread: warm up, then take a batch, run it, hand the results to the loop.

        Worker k > 0 takes a batch only while workers 0..k-1 are all busy and half a full
        batch is waiting: a pass has a fixed cost, so small batches side by side waste it,
        while a backlog is worth a second pass. Half, not a full one: a backlog that
        builds slowly (a cache answering half the items) otherwise waits for the pass
        running and then runs alone on every core, which on a CPU does less per core than
        two passes side by side (benchmarks/cache.py: 75 -> 79 calls/s at 8 texts a call;
        benchmarks/alternate.py at C=16 and C=64: 1.01x and 1.03x, in 4 and 5 of 6 rounds).
        A lone request always meets worker 0, and a pass with nothing beside it and nothing
        waiting may use every core (see ThreadShare).
        """
        try:
            if index:  # one at a time, in order, as each would run
                self._warmed[index - 1].result()
            self.runner.warm_up(alone=index == 0)
        except BaseException as exc:  # the model cannot run: the server must not start
            self._warmed[index].set_exception(exc)
            return
        self._warmed[index].set_result(None)
        while True:
            with self._lock:
                self._wakes[index].wait_for(lambda: self._stopping or self._may_take(index))
                if self._stopping:
                    return
            if self.config.batch_wait_s and self._size < self.config.max_batch_size:
                time.sleep(self.config.batch_wait_s)
            with self._lock:
                expired = self._drop_dead()
                batch = self._take_batch()
                if batch:
                    self._busy[index] = True
                    self._computing[index] = batch
                    alone = sum(self._busy) == 1 and not self._pending
                    self._wake_eligible()  # the next worker may now take a batch
            if expired:
                self._hand_over([(job, _expired()) for job in expired], None)
            if batch:
                try:
                    self._run(batch, alone)
                finally:
                    with self._lock:
                        self._busy[index] = False
                        self._computing[index] = []
                # Not held until this worker's next batch: its items hold their jobs, and a
                # job its raw outputs (a large one's, hundreds of MB, kept while idle).
                batch = expired = []

    def _may_take(self, index: int) -> bool:
        if not self._pending:
            return False
        if index == 0:
            return True
        return all(self._busy[:index]) and self._size >= self.config.max_batch_size // 2

    def _call_in_loop(self, callback: Callable[..., None], *args: object) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop closed at shutdown: nobody waits
            self._loop.call_soon_threadsafe(callback, *args)

    def _run(self, batch: list[QueuedItem], alone: bool) -> None:
        sequences = [item.sequence for item in batch]
        started = time.monotonic()
        outputs: list[np.ndarray] | None = None
        error: BaseException | None = None
        try:
            keep = [item.keep_tokens for item in batch]
            if not _has_adapters(self.runner):
                outputs = self.runner.forward(sequences, keep, alone)
            else:  # each item through its own adapter, in one pass (models/adapters.py)
                adapters = [item.job.adapter for item in batch]
                outputs = self.runner.forward(sequences, keep, alone, adapters)
        except Exception as exc:  # one failed batch fails its items, not the server
            log.exception("forward pass failed for %d items", len(batch))
            error = exc
        finished = time.monotonic()
        lengths = [item.length for item in batch]
        record = BatchRecord(
            len(batch),
            sum(lengths),
            max(lengths) * len(batch),
            [started - item.enqueued for item in batch],
            finished - started,
            error,
            len({item.job.origin for item in batch}),
        )
        completed: list[Job] = []
        outcomes: list[tuple[Job, object]] = []
        landed = self._land_flights(batch, outputs) if self.cache is not None else None
        if outputs is not None:
            outputs = _folded(batch, outputs, outcomes)
        parts: dict[Job, Partial] = {}  # a streaming job's outputs of this batch
        with self._lock:
            if outcomes:  # a fold failed its job: its queued items are dropped
                self._maybe_dead = True
            if outputs is None:
                own: Iterable[tuple[Job, int, np.ndarray | None]] = (
                    (item.job, item.index, None) for item in batch
                )
            else:
                own = (
                    (item.job, item.index, out) for item, out in zip(batch, outputs, strict=True)
                )
            times = (started, finished)
            self._take_outputs(own, times, error, parts, completed, outcomes)
            if landed:
                self._take_outputs(landed, times, error, parts, completed, outcomes)
        if self.cache is not None:
            _with_hits(parts, completed)
        for job, part in parts.items():  # sent now, whether or not they end the job
            part.last = job.remaining == 0
            outcomes.append((job, part))
        for job in completed:  # heads and results, off the event loop
            if job.future.done() or job.streams:
                continue
            try:
                outcomes.append((job, job.finish(job.raws)))
            except Exception as exc:
                log.exception("finishing a request failed")
                outcomes.append((job, exc))
        self._hand_over(outcomes, record)

    def _hand_over(self, outcomes: list[tuple[Job, object]], record: BatchRecord | None) -> None:
        """On a worker thread: the outcomes to `deliver` or to the loop; the batch counted."""
        if self.deliver is not None:
            self.deliver(outcomes)
            outcomes = []
        if outcomes or record is not None:
            self._call_in_loop(self._resolve, outcomes, record)

    def _resolve(self, outcomes: list[tuple[Job, object]], record: BatchRecord | None) -> None:
        """On the event loop: resolve the futures still waited for, then count the batch."""
        settle(outcomes)
        if record is None:
            return
        self.stats.batches += 1
        self.stats.items_computed += record.size
        self.stats.tokens_computed += record.tokens
        self.stats.padded_tokens_computed += record.padded_tokens
        self.stats.failed_batches += record.error is not None
        self.stats.mixed_batches += record.origins > 1
        for observe in self.observers:
            observe(self.runner.info.name, record)


def _has_adapters(runner: ModelRunner) -> bool:
    """Whether the model has LoRA adapters, read once a batch (a stand-in runner has none)."""
    return getattr(runner, "adapters", None) is not None


def _hits_only(job: Job) -> object:
    """A job whose every item the cache answered: a streaming job's one part, or the job
    itself, to be finished."""
    if job.streams:
        return Partial(list(range(len(job.work))), list(job.raws), True)
    return job


def _with_hits(parts: dict[Job, Partial], completed: list[Job]) -> None:
    """A streaming job's cache hits (kept in its raws) go out with its last part."""
    for job in completed:
        if job.streams and job.cached and job in parts:
            part = parts[job]
            taken = set(part.indices)
            for index, raw in enumerate(job.raws):
                if raw is not None and index not in taken:
                    part.indices.append(index)
                    part.raws.append(raw)


def _folded(
    batch: list[QueuedItem], outputs: list[np.ndarray], outcomes: list[tuple[Job, object]]
) -> list[np.ndarray]:
    """Each live job's `fold` applied to its outputs of the batch (outside the lock); a
    fold that fails fails its job."""
    if all(item.job.fold is None for item in batch):
        return outputs
    outputs = list(outputs)
    for position, item in enumerate(batch):
        job = item.job
        if job.fold is None or job.dead:
            continue
        try:
            outputs[position] = job.fold(item.index, outputs[position])
        except Exception as exc:
            log.exception("finishing a request's output failed")
            job.failed = True
            outcomes.append((job, exc))
    return outputs


def _expired() -> PoolingError:
    return PoolingError(
        ErrorKind.DEADLINE_EXCEEDED,
        "DEADLINE_EXCEEDED",
        "the deadline passed while the request was queued",
    )


def _forward_error(exc: BaseException | None) -> PoolingError:
    if "out of memory" in str(exc).lower():
        return PoolingError(
            ErrorKind.RESOURCE_EXHAUSTED,
            "OUT_OF_MEMORY",
            "the model ran out of memory on this batch; retry with fewer or shorter texts",
            retry_after_s=1.0,
        )
    return PoolingError(ErrorKind.INTERNAL, "FORWARD_FAILED", "the model failed on this batch")
