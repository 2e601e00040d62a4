"""Per-model batching queue: items wait with an asyncio future each; a worker forms batches.

The model's worker threads each take the next batch the moment their previous forward pass
ends, without a round trip through the event loop, so the model never idles while the
loop is busy answering; the loop meanwhile keeps accepting work. With two workers one
batch is collated (and copied to the GPU) while the other computes; on a CPU, two workers
of one intra-op thread each get more from the cores than one worker of two threads, whose
parallel regions stall whenever the event loop takes a core. A batch is built around
an anchor item from the items closest to it in length, within a budget of padded tokens
(longest x count), a cap on items and a minimum share of real (non-padding) tokens.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from engine.errors import ErrorKind, PoolingError
from engine.model_runner import ModelRunner
from engine.tokenization import Encoding

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchConfig:
    max_batch_tokens: int = 16384
    max_batch_size: int = 32  # 0: chosen by the server for the device
    workers: int = 1  # forward-pass threads sharing the model; 0: chosen by the server
    batch_wait_s: float = 0.0
    max_queued_items: int = 100_000
    # A batch grows only while real tokens / padded tokens stays above this.
    min_padding_efficiency: float = 0.8
    # How many of the oldest items a scheduling step looks at; bounds its cost.
    lookahead: int = 2048


@dataclass
class RequestTiming:
    """When a request's items entered the queue, and the span of the batches that ran them."""

    enqueued: float = 0.0
    started: float | None = None
    finished: float | None = None

    def add_batch(self, started: float, finished: float) -> None:
        self.started = started if self.started is None else min(self.started, started)
        self.finished = finished if self.finished is None else max(self.finished, finished)


@dataclass(eq=False)
class QueuedItem:
    encoding: Encoding
    keep_tokens: bool
    future: asyncio.Future[np.ndarray]
    deadline: float | None
    enqueued: float = field(default_factory=time.monotonic)
    timing: RequestTiming | None = None
    counted: bool = True  # still part of the queue depth


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


@dataclass(frozen=True)
class BatchRecord:
    """What one finished batch looked like, for observers (metrics, tracing)."""

    size: int
    tokens: int
    padded_tokens: int
    queue_wait_s: Sequence[float]
    forward_s: float
    error: BaseException | None


class BatchQueue:
    def __init__(self, runner: ModelRunner, config: BatchConfig) -> None:
        self.runner = runner
        self.config = config
        self.stats = QueueStats()
        self.observers: list[Callable[[str, BatchRecord], None]] = []
        self._pending: list[QueuedItem] = []
        self._waiting = 0
        self._lock = threading.Condition(threading.RLock())  # re-entered by _uncount
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._workers = [
            threading.Thread(
                target=self._work, args=(k,), name=f"forward-{runner.info.name}-{k}", daemon=True
            )
            for k in range(max(1, config.workers))
        ]
        self._warmed = [concurrent.futures.Future[None]() for _ in self._workers]
        self._busy = [False] * len(self._workers)

    @property
    def depth(self) -> int:
        """Items waiting for a batch whose caller still waits (cancelled ones do not count)."""
        return self._waiting

    def _has_room(self, count: int) -> bool:
        """Recount only when near the bound: cancellations reach `depth` a loop turn late."""
        bound = self.config.max_queued_items
        if self._waiting + count <= bound:
            return True
        with self._lock:
            live = sum(item.counted and not item.future.done() for item in self._pending)
        return live + count <= bound

    def _uncount(self, item: QueuedItem) -> None:
        """An item leaves the depth once: when a batch takes it or its future is done."""
        with self._lock:
            if item.counted:
                item.counted = False
                self._waiting -= 1

    async def start(self) -> None:
        """Start the workers; returns once each has warmed the model up on its own thread."""
        self._loop = asyncio.get_running_loop()
        for worker in self._workers:
            worker.start()
        await asyncio.gather(*(asyncio.wrap_future(warmed) for warmed in self._warmed))

    async def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        for worker in self._workers:
            await asyncio.to_thread(worker.join)

    def submit(
        self,
        work: Sequence[tuple[Encoding, bool]],
        deadline: float | None = None,
        timing: RequestTiming | None = None,
    ) -> list[asyncio.Future[np.ndarray]]:
        """Queue sequences (with whether every token's state is wanted); all or none.

        `timing`, when given, is filled in as the items' batches run.
        """
        if not self._has_room(len(work)):
            raise PoolingError(
                ErrorKind.RESOURCE_EXHAUSTED,
                "QUEUE_FULL",
                f"the queue of model {self.runner.info.name} is full "
                f"({self.config.max_queued_items} items); retry later",
                retry_after_s=1.0,
            )
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        if timing is not None:
            timing.enqueued = now
        items = [
            QueuedItem(enc, keep, loop.create_future(), deadline, now, timing=timing)
            for enc, keep in work
        ]
        with self._lock:
            self._pending.extend(items)
            self._waiting += len(items)
            self._lock.notify_all()  # only some workers may take work now
        for item in items:
            item.future.add_done_callback(lambda _, item=item: self._uncount(item))
        return [item.future for item in items]

    def _drop_dead(self) -> list[QueuedItem]:
        """Remove cancelled items and return those whose deadline has passed."""
        now = time.monotonic()
        alive, expired = [], []
        for item in self._pending:
            if item.future.done():
                self.stats.dropped_cancelled += 1
            elif item.deadline is not None and now >= item.deadline:
                self.stats.dropped_expired += 1
                expired.append(item)
            else:
                alive.append(item)
        self._pending = alive
        return expired

    def _take_batch(self) -> list[QueuedItem]:
        """The oldest item, then the items closest to it in length while the batch stays dense.

        Anchoring on the oldest item means nothing starves: a long text waits only for the
        items queued before it, and is then batched with texts of its own length rather
        than padded against short ones.
        """
        if not self._pending:
            return []
        config = self.config
        window = self._pending[: config.lookahead]
        anchor_len = len(window[0].encoding)
        by_closeness = sorted(
            range(1, len(window)), key=lambda i: (abs(len(window[i].encoding) - anchor_len), i)
        )
        chosen, longest, real = [0], anchor_len, anchor_len
        for i in by_closeness:
            if len(chosen) >= config.max_batch_size:
                break
            n = len(window[i].encoding)
            padded = max(longest, n) * (len(chosen) + 1)
            if (
                padded > config.max_batch_tokens
                or real + n < config.min_padding_efficiency * padded
            ):
                continue
            chosen.append(i)
            longest, real = max(longest, n), real + n
        taken = set(chosen)
        batch = [window[i] for i in sorted(taken)]
        for item in batch:
            self._uncount(item)
        rest_of_window = [item for i, item in enumerate(window) if i not in taken]
        self._pending = rest_of_window + self._pending[len(window) :]
        return batch

    def _work(self, index: int) -> None:
        """A worker thread: warm up, then take a batch, run it, hand the results to the loop.

        Worker k takes a batch only while workers 0..k-1 are all busy, so a lone request
        always meets worker 0, whose forward pass may then use every core.
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
                self._lock.wait_for(
                    lambda: self._stopping or (self._pending and all(self._busy[:index]))
                )
                if self._stopping:
                    return
            if self.config.batch_wait_s and len(self._pending) < self.config.max_batch_size:
                time.sleep(self.config.batch_wait_s)
            with self._lock:
                expired = self._drop_dead()
                batch = self._take_batch()
                if batch:
                    self._busy[index] = True
                    alone = sum(self._busy) == 1
                    self._lock.notify_all()  # the next worker may now take a batch
            if expired:
                self._call_in_loop(self._expire, expired)
            if batch:
                try:
                    self._run(batch, alone)
                finally:
                    with self._lock:
                        self._busy[index] = False

    def _call_in_loop(self, callback: Callable[..., None], *args: object) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop closed at shutdown: nobody waits
            self._loop.call_soon_threadsafe(callback, *args)

    @staticmethod
    def _expire(items: list[QueuedItem]) -> None:
        for item in items:
            if not item.future.done():
                item.future.set_exception(
                    PoolingError(
                        ErrorKind.DEADLINE_EXCEEDED,
                        "DEADLINE_EXCEEDED",
                        "the deadline passed while the request was queued",
                    )
                )

    def _run(self, batch: list[QueuedItem], alone: bool) -> None:
        encodings = [item.encoding for item in batch]
        started = time.monotonic()
        outputs: list[np.ndarray] | None = None
        error: BaseException | None = None
        try:
            outputs = self.runner.forward(encodings, [item.keep_tokens for item in batch], alone)
        except Exception as exc:  # one failed batch fails its items, not the server
            log.exception("forward pass failed for %d items", len(batch))
            error = exc
        finished = time.monotonic()
        for item in batch:
            if item.timing is not None:
                item.timing.add_batch(started, finished)
        record = BatchRecord(
            len(batch),
            sum(len(e) for e in encodings),
            max(len(e) for e in encodings) * len(encodings),
            [started - item.enqueued for item in batch],
            finished - started,
            error,
        )
        self._call_in_loop(self._deliver, batch, outputs, record)

    def _deliver(
        self, batch: list[QueuedItem], outputs: list[np.ndarray] | None, record: BatchRecord
    ) -> None:
        """On the event loop: resolve the futures still waited for, update stats."""
        if outputs is None:
            failure = _forward_error(record.error)
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(failure)
        else:
            for item, output in zip(batch, outputs, strict=True):
                if not item.future.done():
                    item.future.set_result(output)
        self.stats.batches += 1
        self.stats.items_computed += record.size
        self.stats.tokens_computed += record.tokens
        self.stats.padded_tokens_computed += record.padded_tokens
        self.stats.failed_batches += record.error is not None
        for observe in self.observers:
            observe(self.runner.info.name, record)


def _forward_error(exc: BaseException | None) -> PoolingError:
    if "out of memory" in str(exc).lower():
        return PoolingError(
            ErrorKind.RESOURCE_EXHAUSTED,
            "OUT_OF_MEMORY",
            "the model ran out of memory on this batch; retry with fewer or shorter texts",
            retry_after_s=1.0,
        )
    return PoolingError(ErrorKind.INTERNAL, "FORWARD_FAILED", "the model failed on this batch")
