"""Per-model batching queue: items wait with a future each; a scheduler forms batches.

A batch is built around the oldest waiting item (so nothing starves) from the items
closest to it in length (so little is spent on padding), within a budget of padded
tokens (longest x count) and a cap on items. The forward pass runs in the model's own
worker thread, so the event loop keeps accepting work while the model computes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from engine.errors import ErrorKind, PoolingError
from engine.model_runner import ModelRunner
from engine.tokenization import Encoding

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchConfig:
    max_batch_tokens: int = 16384
    max_batch_size: int = 256
    batch_wait_s: float = 0.0
    max_queued_items: int = 100_000
    # How many of the oldest items a scheduling step looks at; bounds its cost.
    lookahead: int = 2048


@dataclass(eq=False)
class QueuedItem:
    encoding: Encoding
    keep_tokens: bool
    future: asyncio.Future[np.ndarray]
    deadline: float | None
    enqueued: float = field(default_factory=time.monotonic)


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
        self.observers: list = []
        self._pending: list[QueuedItem] = []
        self._wakeup = asyncio.Event()
        self._worker = ThreadPoolExecutor(1, thread_name_prefix=f"forward-{runner.info.name}")
        self._task: asyncio.Task[None] | None = None

    @property
    def depth(self) -> int:
        return len(self._pending)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._schedule())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._worker.shutdown(wait=True)

    def submit(
        self, work: Sequence[tuple[Encoding, bool]], deadline: float | None = None
    ) -> list[asyncio.Future[np.ndarray]]:
        """Queue sequences (with whether every token's state is wanted); all or none."""
        if len(self._pending) + len(work) > self.config.max_queued_items:
            raise PoolingError(
                ErrorKind.RESOURCE_EXHAUSTED,
                "QUEUE_FULL",
                f"the queue of model {self.runner.info.name} is full "
                f"({self.config.max_queued_items} items); retry later",
                retry_after_s=1.0,
            )
        loop = asyncio.get_running_loop()
        items = [QueuedItem(enc, keep, loop.create_future(), deadline) for enc, keep in work]
        self._pending.extend(items)
        self._wakeup.set()
        return [item.future for item in items]

    def _drop_dead(self) -> None:
        now = time.monotonic()
        alive = []
        for item in self._pending:
            if item.future.done():
                self.stats.dropped_cancelled += 1
            elif item.deadline is not None and now >= item.deadline:
                self.stats.dropped_expired += 1
                item.future.set_exception(
                    PoolingError(
                        ErrorKind.DEADLINE_EXCEEDED,
                        "DEADLINE_EXCEEDED",
                        "the deadline passed while the request was queued",
                    )
                )
            else:
                alive.append(item)
        self._pending = alive

    def _take_batch(self) -> list[QueuedItem]:
        self._drop_dead()
        if not self._pending:
            return []
        window = self._pending[: self.config.lookahead]
        anchor_len = len(window[0].encoding)
        by_closeness = sorted(
            range(len(window)), key=lambda i: (abs(len(window[i].encoding) - anchor_len), i)
        )
        chosen: list[int] = []
        longest = 0
        for i in by_closeness:
            n = len(window[i].encoding)
            if chosen and max(longest, n) * (len(chosen) + 1) > self.config.max_batch_tokens:
                continue
            chosen.append(i)
            longest = max(longest, n)
            if len(chosen) >= self.config.max_batch_size:
                break
        taken = set(chosen)
        batch = [window[i] for i in sorted(chosen)]
        self._pending = [item for i, item in enumerate(window) if i not in taken] + self._pending[
            len(window) :
        ]
        return batch

    async def _schedule(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wakeup.wait()
            if self.config.batch_wait_s and len(self._pending) < self.config.max_batch_size:
                await asyncio.sleep(self.config.batch_wait_s)
            batch = self._take_batch()
            if not batch:
                self._wakeup.clear()
                continue
            await self._run(loop, batch)

    async def _run(self, loop: asyncio.AbstractEventLoop, batch: list[QueuedItem]) -> None:
        encodings = [item.encoding for item in batch]
        started = time.monotonic()
        error: BaseException | None = None
        try:
            outputs = await loop.run_in_executor(
                self._worker, self.runner.forward, encodings, [item.keep_tokens for item in batch]
            )
        except Exception as exc:  # one failed batch fails its items, not the server
            log.exception("forward pass failed for %d items", len(batch))
            error = exc
            self.stats.failed_batches += 1
            failure = _forward_error(exc)
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(failure)
        else:
            for item, output in zip(batch, outputs, strict=True):
                if not item.future.done():
                    item.future.set_result(output)
        tokens = sum(len(e) for e in encodings)
        padded = max(len(e) for e in encodings) * len(encodings)
        self.stats.batches += 1
        self.stats.items_computed += len(batch)
        self.stats.tokens_computed += tokens
        self.stats.padded_tokens_computed += padded
        record = BatchRecord(
            len(batch),
            tokens,
            padded,
            [started - item.enqueued for item in batch],
            time.monotonic() - started,
            error,
        )
        for observe in self.observers:
            observe(self.runner.info.name, record)


def _forward_error(exc: BaseException) -> PoolingError:
    if "out of memory" in str(exc).lower():
        return PoolingError(
            ErrorKind.RESOURCE_EXHAUSTED,
            "OUT_OF_MEMORY",
            "the model ran out of memory on this batch; retry with fewer or shorter texts",
            retry_after_s=1.0,
        )
    return PoolingError(ErrorKind.INTERNAL, "FORWARD_FAILED", "the model failed on this batch")
