"""Batch forming in numpy (BatchQueue._choose) against the rule it replaced, item by item.

The queue's batches were formed by a Python sort of the window; they are now formed with
numpy and a prefix found at once. Both must pick the same items, in the same order, for any
queue: many clients or one, any lengths, any limits. No model and no worker thread: the
queue is filled and drained directly.
"""

from __future__ import annotations

import asyncio
import math
import random
import types

import pytest

from pooling_server.engine.inputs.tokenization import TokenSequence
from pooling_server.engine.scheduling.batch_queue import BatchConfig, BatchQueue, QueuedItem
from pooling_server.engine.scheduling.jobs import Job


def _reference_take(queue: BatchQueue) -> list[QueuedItem]:
    """BatchQueue._take_batch as it was: the window sorted in Python, the greedy rule."""
    if not queue._pending:
        return []
    config = queue.config
    parts = queue._window()
    window: list[QueuedItem] = []
    rank: list[int] = []
    turns = len(parts)
    for turn, (_, part) in enumerate(parts):
        window += part
        rank += range(turn, turn + turns * len(part), turns)
    anchor_len = len(window[0].sequence)
    by_closeness = sorted(
        range(1, len(window)), key=lambda i: (abs(len(window[i].sequence) - anchor_len), rank[i])
    )
    chosen, longest, real = [0], anchor_len, anchor_len
    for i in by_closeness:
        if len(chosen) >= config.max_batch_size:
            break
        n = len(window[i].sequence)
        padded = max(longest, n) * (len(chosen) + 1)
        if padded > config.max_batch_tokens or real + n < config.min_padding_efficiency * padded:
            continue
        chosen.append(i)
        longest, real = max(longest, n), real + n
    chosen.sort()
    batch = [window[i] for i in chosen]
    taken = {id(item) for item in batch}
    for key, part in parts:
        rest = [item for item in part if id(item) not in taken] + queue._pending[key][len(part) :]
        if rest:
            queue._pending[key] = rest
        else:
            del queue._pending[key]
    anchor = parts[0][0]
    if anchor in queue._pending and len(queue._pending) > 1:
        queue._pending[anchor] = queue._pending.pop(anchor)
    queue._size -= len(batch)
    return batch


def _queue(config: BatchConfig, jobs: list[tuple[str, list[int]]]) -> BatchQueue:
    runner = types.SimpleNamespace(info=types.SimpleNamespace(name="m"))
    queue = BatchQueue(runner, config)  # type: ignore[arg-type]
    loop = asyncio.new_event_loop()
    try:
        for key, (client, lengths) in enumerate(jobs):
            work = [(TokenSequence(list(range(n)), None, [], []), False) for n in lengths]
            job = Job(work, list, loop.create_future(), client=client, key=key)
            assert not queue.enqueue([job])
    finally:
        loop.close()
    return queue


@pytest.mark.parametrize("seed", range(24))
def test_batches_are_the_ones_the_python_sort_formed(seed: int) -> None:
    rng = random.Random(seed)
    config = BatchConfig(
        max_batch_size=rng.choice([0, 1, 4, 32, 256]),
        max_batch_tokens=rng.choice([64, 600, 16384]),
        min_padding_efficiency=rng.choice([0.0, 0.5, 0.8, 0.95]),
        lookahead=rng.choice([3, 64, 2048]),
        max_queued_items=100_000,
        max_queued_items_per_client=100_000,
    )
    clients = [f"c{k}" for k in range(rng.choice([1, 2, 5, 40]))]
    spread = rng.choice([(20, 20), (16, 24), (1, 60)])
    jobs = [
        (rng.choice(clients), [rng.randint(*spread) for _ in range(rng.choice([1, 1, 3]))])
        for _ in range(rng.randint(1, 600))
    ]
    new, old = _queue(config, jobs), _queue(config, jobs)
    while old._pending:
        expected = _reference_take(old)
        got = new._take_batch()
        assert [(i.job.key, i.index) for i in got] == [(i.job.key, i.index) for i in expected]
        assert list(new._pending) == list(old._pending)
        assert new._size == old._size
    assert not new._pending


def test_a_queue_told_of_cancels_walks_only_after_one_or_a_deadline() -> None:
    """An engine process tells the queue of each cancel (`cancelled()`): the items are then
    looked at again only after one, after a failed batch, or once a deadline has passed."""
    queue = _queue(BatchConfig(max_batch_size=1), [("a", [5]), ("a", [6])])
    queue.told_of_cancels = True
    first, second = (item.job for item in queue._pending[0, "a"])
    first.future.cancel()
    assert queue._drop_dead() == [] and queue._size == 2  # not told yet: not looked at
    queue.cancelled()
    assert queue._drop_dead() == [] and queue._size == 1
    assert queue.stats.dropped_cancelled == 1

    loop = asyncio.new_event_loop()
    late = Job([(TokenSequence([1, 2], None, [], []), False)], list, loop.create_future(), -1.0)
    loop.close()
    assert not queue.enqueue([late])  # its deadline has passed: the next step fails it
    assert queue._drop_dead() == [late] and late.failed
    assert queue.stats.dropped_expired == 1
    assert queue._next_deadline == math.inf  # nothing queued has a deadline any more
    assert [item.job for item in queue._take_batch()] == [second]
