"""The batching queue, in process: batched results, cancellation, deadlines, limits, faults.

The model runner is wrapped by `ControlledRunner`, which records every batch the worker
hands it and can hold batches until the test lets them go, so each test decides exactly
what is queued when a batch is taken, with events rather than sleeps. pytest-asyncio is
not installed: each test is a sync function that drives its scenario with `asyncio.run`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
import torch

from pooling_server.engine.errors import ErrorKind, PoolingError
from pooling_server.engine.inputs.tokenization import TokenSequence
from pooling_server.engine.models.loader import LoadedModel, ModelSpec, load_model
from pooling_server.engine.requests.outputs import (
    Classification,
    Embedding,
    PoolResult,
    Score,
    TokenRows,
)
from pooling_server.engine.requests.params import PoolingParams, Task
from pooling_server.engine.requests.plans import plan_request
from pooling_server.engine.requests.request import PoolRequest
from pooling_server.engine.scheduling.batch_queue import BatchConfig, BatchQueue, BatchRecord, Job
from pooling_server.engine.scheduling.engine import Engine, Timings

pytestmark = pytest.mark.timeout(120)

T = TypeVar("T")
WAIT_S = 30.0  # generous: only ever reached when something is broken
ATOL = 1e-5
VOCABULARY = (
    "the quick brown fox jumps over lazy dog cell energy river mountain city light "
    "paper music garden window table coffee morning evening ocean forest stone cloud"
)
WORDS = VOCABULARY.split()


# ---------------------------------------------------------------------------------------
# Helpers: a controllable runner, and running an engine or a bare queue in a fresh loop
# ---------------------------------------------------------------------------------------


class ControlledRunner:
    """Stands in for a ModelRunner: records each batch; can hold batches or fail them.

    Batch n (1-based) may run only once `n <= allowed` (`allowed is None`: no holding).
    `hold_first=True` holds the first batch until `open()`; `stepping=True` lets one
    batch through per `step()`. `fail(batch)` may return an exception to raise instead
    of computing.
    """

    def __init__(
        self,
        inner: Any,
        *,
        hold_first: bool = False,
        stepping: bool = False,
        fail: Callable[[Sequence[TokenSequence]], Exception | None] | None = None,
    ) -> None:
        self.inner = inner
        self.info = inner.info
        self.fail = fail
        self.batches: list[list[TokenSequence]] = []
        self.calls: list[tuple[str, bool]] = []  # (worker thread, alone) per forward pass
        self.allowed: int | None = 0 if (hold_first or stepping) else None
        self._changed = threading.Condition()

    def forward(
        self, batch: Sequence[TokenSequence], keep_tokens: Sequence[bool], alone: bool = True
    ) -> list[np.ndarray]:
        with self._changed:
            self.batches.append(list(batch))
            self.calls.append((threading.current_thread().name, alone))
            number = len(self.batches)
            self._changed.notify_all()
            if not self._changed.wait_for(
                lambda: self.allowed is None or number <= self.allowed, timeout=WAIT_S
            ):
                raise RuntimeError("test runner: batch held too long")
        failure = self.fail(batch) if self.fail else None
        if failure is not None:
            raise failure
        return self.inner.forward(batch, keep_tokens, alone)

    def warm_up(self, alone: bool = True) -> None:
        self.inner.warm_up(alone)

    def open(self) -> None:
        with self._changed:
            self.allowed = None
            self._changed.notify_all()

    def step(self) -> None:
        with self._changed:
            assert self.allowed is not None
            self.allowed += 1
            self._changed.notify_all()

    def wait_entered(self, count: int) -> None:
        """Block until `count` batches have reached forward()."""
        with self._changed:
            assert self._changed.wait_for(lambda: len(self.batches) >= count, timeout=WAIT_S), (
                f"only {len(self.batches)} of {count} batches started"
            )

    async def entered(self, count: int) -> None:
        await asyncio.to_thread(self.wait_entered, count)

    @property
    def seen(self) -> set[tuple[int, ...]]:
        """The token ids of every sequence handed to forward()."""
        with self._changed:
            return {tuple(e.input_ids) for batch in self.batches for e in batch}


async def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.002)


def with_runner(model: LoadedModel, **options: Any) -> tuple[LoadedModel, ControlledRunner]:
    runner = ControlledRunner(model.runner, **options)
    return dataclasses.replace(model, runner=runner), runner  # type: ignore[arg-type]


def run_engine(
    models: Sequence[LoadedModel],
    body: Callable[[Engine], Awaitable[T]],
    config: BatchConfig | None = None,
) -> T:
    """Start an engine over `models`, run `body(engine)`, and always stop it again."""

    async def main() -> T:
        engine = Engine(models, batch_config=config or BatchConfig())
        await engine.start()
        try:
            return await asyncio.wait_for(body(engine), WAIT_S * 2)
        finally:
            for model in models:  # nothing may stay held, or stop() would wait forever
                if isinstance(model.runner, ControlledRunner):
                    model.runner.open()
            await engine.stop()

    return asyncio.run(main())


def run_queue(
    runner: ControlledRunner, config: BatchConfig, body: Callable[[BatchQueue], Awaitable[T]]
) -> T:
    async def main() -> T:
        queue = BatchQueue(runner, config)  # type: ignore[arg-type]
        await queue.start()
        try:
            return await asyncio.wait_for(body(queue), WAIT_S * 2)
        finally:
            runner.open()
            await queue.stop()

    return asyncio.run(main())


def submit(queue: BatchQueue, sequences: Sequence[TokenSequence]) -> list[asyncio.Future[Any]]:
    """Queue each sequence as its own job; each future resolves to that sequence's raw output."""
    loop = asyncio.get_running_loop()
    jobs = [Job([(e, False)], lambda raws: raws[0], loop.create_future()) for e in sequences]
    assert not queue.enqueue(jobs)
    return [job.future for job in jobs]


def embed(*texts: str, model: str = "tiny-bert", **params: Any) -> PoolRequest:
    return PoolRequest(Task.EMBED, PoolingParams(**params), model=model, texts=texts)


def ids_of(model: LoadedModel, texts: Sequence[str]) -> set[tuple[int, ...]]:
    return {tuple(e.input_ids) for e in model.tokenizer.tokenize(texts)}


def of_length(model: LoadedModel, n: int) -> TokenSequence:
    """A sequence of exactly n tokens ("hello" is one token; CLS and SEP add two)."""
    sequence = model.tokenizer.tokenize(["hello " * (n - 2)])[0]
    assert len(sequence) == n
    return sequence


def assert_same_result(got: PoolResult, want: PoolResult, where: str) -> None:
    assert (got.model, got.task, got.prompt_tokens) == (want.model, want.task, want.prompt_tokens)
    assert len(got.outputs) == len(want.outputs), where
    for index, (g, w) in enumerate(zip(got.outputs, want.outputs, strict=True)):
        at = f"{where} item {index}"
        assert type(g) is type(w), at
        if isinstance(g, Embedding):
            a, b = g.values, w.values
        elif isinstance(g, Classification):
            assert isinstance(w, Classification)
            assert (g.label_id, g.label) == (w.label_id, w.label), at
            a, b = g.probs, w.probs
        elif isinstance(g, Score):
            assert isinstance(w, Score)
            a, b = np.array([g.value]), np.array([w.value])
        else:
            assert isinstance(g, TokenRows) and isinstance(w, TokenRows)
            assert g.token_ids == w.token_ids and g.offsets == w.offsets, at
            assert g.special_tokens_mask == w.special_tokens_mask, at
            assert (g.label_ids, g.labels) == (w.label_ids, w.labels), at
            a, b = g.values, w.values
        assert a.shape == b.shape, at
        assert float(np.max(np.abs(a - b))) <= ATOL, f"{at}: {np.max(np.abs(a - b))}"


# ---------------------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------------------


def _load(folder: Path, name: str) -> LoadedModel:
    return load_model(
        ModelSpec(source=str(folder), name=name),
        device=torch.device("cpu"),
        dtype=torch.float32,
    )


@pytest.fixture(scope="module")
def bert(model_folders: dict[str, Path]) -> LoadedModel:
    return _load(model_folders["tiny-bert"], "tiny-bert")


@pytest.fixture(scope="module")
def classifier(model_folders: dict[str, Path]) -> LoadedModel:
    return _load(model_folders["tiny-classifier"], "tiny-classifier")


# ---------------------------------------------------------------------------------------
# Batching correctness
# ---------------------------------------------------------------------------------------


def _mixed_requests(count: int) -> list[PoolRequest]:
    rng = random.Random(1234)

    def text() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 45)))

    def texts() -> tuple[str, ...]:
        return tuple(text() for _ in range(rng.randint(1, 4)))

    requests = []
    for i in range(count):
        rid = f"r{i}"
        kind = i % 9
        if kind == 0:
            request = PoolRequest(Task.EMBED, request_id=rid, model="tiny-bert", texts=texts())
        elif kind in (1, 2):
            params = PoolingParams(use_activation=kind == 2)
            request = PoolRequest(Task.EMBED, params, rid, "tiny-bert", texts=texts())
        elif kind == 3:
            params = PoolingParams(truncate_prompt_tokens=9)
            request = PoolRequest(Task.EMBED, params, rid, "tiny-bert", texts=texts())
        elif kind in (4, 5):
            params = PoolingParams(use_activation=False if kind == 5 else None)
            request = PoolRequest(Task.TOKEN_EMBED, params, rid, "tiny-bert", texts=texts())
        elif kind == 6:  # 1:N and N:N cosine scores over the embeddings
            docs = texts()
            queries = (text(),) if i % 2 else tuple(text() for _ in docs)
            request = PoolRequest(
                Task.SCORE, request_id=rid, model="tiny-bert", text_1=queries, text_2=docs
            )
        else:
            params = PoolingParams(use_activation=False if kind == 8 else None)
            request = PoolRequest(Task.CLASSIFY, params, rid, "tiny-classifier", texts=texts())
        requests.append(request)
    return requests


def _one_by_one(models: Sequence[LoadedModel], requests: list[PoolRequest]) -> list[PoolResult]:
    """The reference: every sequence alone in its batch (no padding), one request at a time."""

    async def body(engine: Engine) -> list[PoolResult]:
        return [await engine.pool(request) for request in requests]

    return run_engine(models, body, BatchConfig(max_batch_size=1))


def test_concurrent_burst_equals_one_by_one(bert: LoadedModel, classifier: LoadedModel) -> None:
    requests = _mixed_requests(40)
    expected = _one_by_one([bert, classifier], requests)

    held_bert, bert_runner = with_runner(bert, hold_first=True)
    held_classifier, classifier_runner = with_runner(classifier, hold_first=True)
    runners = {"tiny-bert": (bert, bert_runner), "tiny-classifier": (classifier, classifier_runner)}
    sequences = {name: 0 for name in runners}
    for request in requests:
        model, _ = runners[request.model]
        sequences[request.model] += len(plan_request(request, model).work)
    records: list[tuple[str, BatchRecord]] = []

    async def burst(engine: Engine) -> list[PoolResult]:
        for queue in engine.queues.values():
            queue.observers.append(lambda name, record: records.append((name, record)))
        tasks = [asyncio.ensure_future(engine.pool(request)) for request in requests]

        def all_queued() -> bool:
            # The first batch of each model is held, so every sequence is either in it or queued.
            return all(
                engine.queues[name].depth + sum(len(b) for b in runner.batches) == sequences[name]
                for name, (_, runner) in runners.items()
            )

        await wait_until(all_queued, "every request to be queued")
        bert_runner.open()
        classifier_runner.open()
        return list(await asyncio.gather(*tasks))

    got = run_engine([held_bert, held_classifier], burst)

    for request, g, w in zip(requests, got, expected, strict=True):
        assert_same_result(g, w, f"{request.request_id} ({request.task} on {request.model})")
    for name in runners:
        sizes = [record.size for model, record in records if model == name]
        assert sum(sizes) == sequences[name]
        assert max(sizes) > 1, f"{name}: no batch held more than one sequence: {sizes}"
    assert all(record.error is None for _, record in records)


def test_workers_run_batches_side_by_side(bert: LoadedModel, classifier: LoadedModel) -> None:
    """Two workers hold two batches of one model at once; results still match one by one."""
    requests = _mixed_requests(24)
    expected = _one_by_one([bert, classifier], requests)
    held_bert, bert_runner = with_runner(bert, hold_first=True)
    held_classifier, classifier_runner = with_runner(classifier, hold_first=True)

    async def burst(engine: Engine) -> list[PoolResult]:
        tasks = [asyncio.ensure_future(engine.pool(request)) for request in requests]
        # Nothing is let through yet: only a second worker can have entered a second batch.
        await bert_runner.entered(2)
        await classifier_runner.entered(2)
        bert_runner.open()
        classifier_runner.open()
        return list(await asyncio.gather(*tasks))

    got = run_engine([held_bert, held_classifier], burst, BatchConfig(max_batch_size=3, workers=2))
    for request, g, w in zip(requests, got, expected, strict=True):
        assert_same_result(g, w, f"{request.request_id} ({request.task} on {request.model})")
    for runner in (bert_runner, classifier_runner):
        (first_worker, _), (second_worker, second_alone) = runner.calls[:2]
        assert first_worker.endswith("-0"), "worker 0 goes first"
        assert (second_worker[-2:], second_alone) == ("-1", False), "worker 1 only beside it"


def test_a_lone_request_always_meets_the_first_worker(bert: LoadedModel) -> None:
    """So a lone forward pass may use every core (see ThreadShare)."""
    model, runner = with_runner(bert)

    async def one_by_one(engine: Engine) -> None:
        for i in range(6):
            await engine.pool(embed(f"text number {i}"))

    run_engine([model], one_by_one, BatchConfig(workers=3))
    assert len(runner.calls) == 6
    assert all(worker.endswith("-0") and alone for worker, alone in runner.calls), runner.calls


# ---------------------------------------------------------------------------------------
# Cancellation and deadlines
# ---------------------------------------------------------------------------------------


def test_cancelled_requests_are_never_computed(bert: LoadedModel) -> None:
    model, runner = with_runner(bert, hold_first=True)
    victim_texts = ("cancelled alpha river", "cancelled beta mountain", "cancelled gamma city")

    async def body(engine: Engine) -> None:
        queue = engine.queues["tiny-bert"]
        blocker = asyncio.ensure_future(engine.pool(embed("the blocking batch")))
        await runner.entered(1)
        victim = asyncio.ensure_future(engine.pool(embed(*victim_texts)))
        await wait_until(lambda: queue.depth == len(victim_texts), "the victim to be queued")
        cancelled_before = queue.stats.dropped_cancelled

        victim.cancel()
        with pytest.raises(asyncio.CancelledError):
            await victim
        runner.open()
        await blocker
        after = await engine.pool(embed("a request after the cancellation"))

        assert len(after.outputs) == 1
        assert queue.stats.dropped_cancelled == cancelled_before + len(victim_texts)
        assert queue.depth == 0
        assert not ids_of(bert, victim_texts) & runner.seen, "a cancelled item was computed"
        assert queue.stats.items_computed == 2

    run_engine([model], body)


def test_deadline_passing_in_the_queue_fails_with_deadline_exceeded(bert: LoadedModel) -> None:
    model, runner = with_runner(bert, hold_first=True)
    late_texts = ("late one ocean", "late two forest")

    async def body(engine: Engine) -> None:
        queue = engine.queues["tiny-bert"]
        blocker = asyncio.ensure_future(engine.pool(embed("the blocking batch")))
        await runner.entered(1)
        deadline = time.monotonic() + 0.2
        late = asyncio.ensure_future(engine.pool(embed(*late_texts), deadline=deadline))
        patient = asyncio.ensure_future(engine.pool(embed("no deadline at all")))
        await wait_until(lambda: queue.depth == 3, "both requests to be queued")
        await wait_until(lambda: time.monotonic() > deadline, "the deadline to pass")
        expired_before = queue.stats.dropped_expired

        runner.open()
        with pytest.raises(PoolingError) as caught:
            await late
        assert caught.value.kind is ErrorKind.DEADLINE_EXCEEDED
        assert caught.value.reason == "DEADLINE_EXCEEDED"
        await blocker
        assert len((await patient).outputs) == 1  # the request beside it is unaffected
        assert queue.stats.dropped_expired == expired_before + len(late_texts)
        assert not ids_of(bert, late_texts) & runner.seen, "an expired item was computed"

    run_engine([model], body)


# ---------------------------------------------------------------------------------------
# Backpressure
# ---------------------------------------------------------------------------------------


def test_full_queue_refuses_whole_requests(bert: LoadedModel) -> None:
    model, runner = with_runner(bert, hold_first=True)
    refused_texts = ("refused first", "refused second")

    async def body(engine: Engine) -> None:
        queue = engine.queues["tiny-bert"]
        blocker = asyncio.ensure_future(engine.pool(embed("the blocking batch")))
        await runner.entered(1)
        three = asyncio.ensure_future(engine.pool(embed("one", "two", "three")))
        await wait_until(lambda: queue.depth == 3, "three items to be queued")

        with pytest.raises(PoolingError) as caught:  # 3 + 2 > 4: all or none
            await engine.pool(embed(*refused_texts))
        error = caught.value
        assert (error.kind, error.reason) == (ErrorKind.RESOURCE_EXHAUSTED, "QUEUE_FULL")
        assert error.retry_after_s is not None and error.retry_after_s > 0
        assert queue.depth == 3, "part of the refused request was queued"

        fourth = asyncio.ensure_future(engine.pool(embed("exactly fills the queue")))
        await wait_until(lambda: queue.depth == 4, "the fourth item to be queued")
        with pytest.raises(PoolingError) as full:
            await engine.pool(embed("one too many"))
        assert full.value.reason == "QUEUE_FULL"

        runner.open()
        results = await asyncio.gather(blocker, three, fourth)
        assert [len(r.outputs) for r in results] == [1, 3, 1]
        assert not ids_of(bert, refused_texts) & runner.seen
        # Once drained, a request of up to max_queued_items fits again.
        assert len((await engine.pool(embed("a", "b", "c", "d"))).outputs) == 4

    run_engine([model], body, BatchConfig(max_queued_items=4))


def test_cancelled_items_do_not_take_up_the_queue_bound(bert: LoadedModel) -> None:
    runner = ControlledRunner(bert.runner, hold_first=True)

    async def body(queue: BatchQueue) -> None:
        first = submit(queue, [of_length(bert, 5)])
        await runner.entered(1)
        for future in submit(queue, [of_length(bert, 5) for _ in range(4)]):
            future.cancel()  # e.g. their clients timed out
        live = submit(queue, [of_length(bert, 5)])  # abandoned work is not counted
        await asyncio.sleep(0)  # done-callbacks run on the next loop iteration
        assert queue.depth == 1
        runner.open()
        await asyncio.gather(*first, *live)

    run_queue(runner, BatchConfig(max_queued_items=4), body)


# ---------------------------------------------------------------------------------------
# Forward failures
# ---------------------------------------------------------------------------------------


def test_forward_failure_fails_only_that_batch(bert: LoadedModel) -> None:
    poison = tuple(bert.tokenizer.tokenize(["poison pill text"])[0].input_ids)

    def fail(batch: Sequence[TokenSequence]) -> Exception | None:
        if any(tuple(e.input_ids) == poison for e in batch):
            return RuntimeError("boom: a kernel failed")
        return None

    model, runner = with_runner(bert, hold_first=True, fail=fail)
    # Same token count, so the poisoned item and `neighbour` form one batch of two.
    texts = {"poisoned": "poison pill text", "neighbour": "garden window table", "next": "a b c"}
    lengths = {len(e) for e in bert.tokenizer.tokenize(list(texts.values()))}
    assert len(lengths) == 1
    records: list[BatchRecord] = []

    async def body(engine: Engine) -> None:
        queue = engine.queues["tiny-bert"]
        queue.observers.append(lambda name, record: records.append(record))
        blocker = asyncio.ensure_future(engine.pool(embed("the blocking batch")))
        await runner.entered(1)
        tasks = {}
        for queued, (key, text) in enumerate(texts.items(), 1):  # one at a time: known order
            tasks[key] = asyncio.ensure_future(engine.pool(embed(text)))
            await wait_until(lambda n=queued: queue.depth == n, f"{key} to be queued")
        runner.open()
        outcomes = dict(
            zip(tasks, await asyncio.gather(*tasks.values(), return_exceptions=True), strict=True)
        )
        await blocker

        for key in ("poisoned", "neighbour"):
            error = outcomes[key]
            assert isinstance(error, PoolingError), f"{key}: {error!r}"
            assert (error.kind, error.reason) == (ErrorKind.INTERNAL, "FORWARD_FAILED")
            assert "boom" not in error.message  # the exception text stays on the server
        assert isinstance(outcomes["next"], PoolResult)
        assert [r.size for r in records] == [1, 2, 1]
        assert [r.error is not None for r in records] == [False, True, False]
        assert queue.stats.failed_batches == 1
        # The queue goes on serving.
        assert len((await engine.pool(embed("after the failure", "and another"))).outputs) == 2

    run_engine([model], body, BatchConfig(max_batch_size=2))


def test_out_of_memory_is_resource_exhausted(bert: LoadedModel) -> None:
    def fail(batch: Sequence[TokenSequence]) -> Exception | None:
        if len(batch[0]) > 20:
            return RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return None

    model, _ = with_runner(bert, fail=fail)

    async def body(engine: Engine) -> None:
        with pytest.raises(PoolingError) as caught:
            await engine.pool(embed("word " * 30))
        error = caught.value
        assert (error.kind, error.reason) == (ErrorKind.RESOURCE_EXHAUSTED, "OUT_OF_MEMORY")
        assert error.retry_after_s is not None
        assert len((await engine.pool(embed("short"))).outputs) == 1

    run_engine([model], body)


# ---------------------------------------------------------------------------------------
# Scheduling: starvation, padding, limits (on a bare BatchQueue, to control the order)
# ---------------------------------------------------------------------------------------


def test_long_text_is_not_starved_by_a_stream_of_short_ones(bert: LoadedModel) -> None:
    config = BatchConfig(max_batch_size=4, min_padding_efficiency=0.8)
    ahead = 6  # short texts queued before the long one
    runner = ControlledRunner(bert.runner, stepping=True)
    short, long = 6, 100  # a long text can never share a batch with short ones (density)

    async def body(queue: BatchQueue) -> int:
        futures = submit(queue, [of_length(bert, short)])  # batch 1, held
        await runner.entered(1)
        futures += submit(queue, [of_length(bert, short) for _ in range(ahead)])
        long_sequence = of_length(bert, long)
        [long_future] = submit(queue, [long_sequence])
        queued_at = len(runner.batches)
        for batch_number in range(2, 30):
            # Short texts keep arriving while each batch runs.
            futures += submit(queue, [of_length(bert, short) for _ in range(3)])
            runner.step()
            await runner.entered(batch_number)
            if any(e is long_sequence for e in runner.batches[-1]):
                break
        runner.open()
        await asyncio.gather(long_future, *futures)
        holding = [i for i, b in enumerate(runner.batches) if any(e is long_sequence for e in b)]
        assert len(holding) == 1
        return holding[0] + 1 - queued_at

    batches_after = run_queue(runner, config, body)
    # The oldest item anchors every batch: the long text waits only for those ahead of it.
    assert 1 <= batches_after <= math.ceil(ahead / config.max_batch_size) + 2, batches_after


def _burst_of_lengths(
    bert: LoadedModel, config: BatchConfig, lengths: Sequence[int]
) -> tuple[list[list[TokenSequence]], list[BatchRecord]]:
    """Queue `lengths` behind a held batch, release, and return the batches the worker formed."""
    runner = ControlledRunner(bert.runner, hold_first=True)
    records: list[BatchRecord] = []

    async def body(queue: BatchQueue) -> None:
        queue.observers.append(lambda name, record: records.append(record))
        first = submit(queue, [of_length(bert, 10)])
        await runner.entered(1)
        futures = submit(queue, [of_length(bert, n) for n in lengths])
        runner.open()
        outputs = await asyncio.gather(*first, *futures)
        assert all(o.shape == (bert.info.hidden_size,) for o in outputs)

    run_queue(runner, config, body)
    batches = runner.batches[1:]  # without the held one
    assert sum(len(b) for b in batches) == len(lengths)
    return batches, records[1:]


def test_mixed_lengths_are_batched_densely(bert: LoadedModel) -> None:
    config = BatchConfig()  # the default asks at least 0.9 of a batch's tokens to be real
    assert config.min_padding_efficiency >= 0.9
    rng = random.Random(7)
    lengths = [rng.randint(3, 128) for _ in range(300)]
    batches, records = _burst_of_lengths(bert, config, lengths)

    real = sum(len(e) for b in batches for e in b)
    padded = sum(max(len(e) for e in b) * len(b) for b in batches)
    assert real / padded >= config.min_padding_efficiency, real / padded
    for batch in batches:
        if len(batch) > 1:
            ratio = sum(len(e) for e in batch) / (max(len(e) for e in batch) * len(batch))
            assert ratio >= config.min_padding_efficiency, [len(e) for e in batch]
    assert max(len(b) for b in batches) > 1
    # Observers see the same numbers the batches had.
    assert [(r.size, r.tokens, r.padded_tokens) for r in records] == [
        (len(b), sum(len(e) for e in b), max(len(e) for e in b) * len(b)) for b in batches
    ]


def test_batches_respect_size_and_token_limits(bert: LoadedModel) -> None:
    config = BatchConfig(max_batch_size=5, max_batch_tokens=200, min_padding_efficiency=0.5)
    rng = random.Random(99)
    lengths = [rng.randint(3, 128) for _ in range(150)]
    batches, _ = _burst_of_lengths(bert, config, lengths)

    for batch in batches:
        padded = max(len(e) for e in batch) * len(batch)
        assert len(batch) <= config.max_batch_size
        assert len(batch) == 1 or padded <= config.max_batch_tokens, [len(e) for e in batch]
    # Sequences over half the token budget can only run alone.
    assert all(len(b) == 1 for b in batches if max(len(e) for e in b) > 100)
    assert any(len(b) == config.max_batch_size for b in batches)


# ---------------------------------------------------------------------------------------
# Fairness between clients: a bound per client, and turns when several wait
# ---------------------------------------------------------------------------------------


def submit_as(
    queue: BatchQueue, client: str, sequences: Sequence[TokenSequence], origin: int = 0
) -> tuple[list[asyncio.Future[Any]], list[tuple[Job, PoolingError]]]:
    """Queue each sequence as its own job of `client`: (the futures, the refused jobs)."""
    loop = asyncio.get_running_loop()
    jobs = [
        Job([(e, False)], lambda raws: raws[0], loop.create_future(), origin=origin, client=client)
        for e in sequences
    ]
    return [job.future for job in jobs], queue.enqueue(jobs)


def test_one_client_is_bounded_and_told_to_back_off_alone(bert: LoadedModel) -> None:
    """Past its own bound a client gets QUEUE_FULL; other clients (a peer of the same name
    behind another front end included) and unnamed callers still queue."""
    runner = ControlledRunner(bert.runner, hold_first=True)
    config = BatchConfig(max_queued_items=20, max_queued_items_per_client=3)

    async def body(queue: BatchQueue) -> None:
        first = submit(queue, [of_length(bert, 5)])
        await runner.entered(1)
        greedy, refused = submit_as(queue, "greedy", [of_length(bert, 5) for _ in range(5)])
        assert len(greedy) - len(refused) == 3, "the first three fit its bound"
        for _job, error in refused:
            assert (error.kind, error.reason) == (ErrorKind.RESOURCE_EXHAUSTED, "QUEUE_FULL")
            assert error.retry_after_s is not None and error.retry_after_s > 0
            assert error.metadata == {"max_queued_items_per_client": "3"}
            assert "3" in error.message and "tiny-bert" in error.message
        polite, none_refused = submit_as(queue, "polite", [of_length(bert, 5) for _ in range(3)])
        assert not none_refused
        # The same peer name from front end 1 is another client.
        other_frontend, none_refused = submit_as(queue, "greedy", [of_length(bert, 5)], origin=1)
        assert not none_refused
        unnamed = submit(queue, [of_length(bert, 5) for _ in range(5)])  # no per-client bound
        assert queue.depth == 3 + 3 + 1 + 5

        # Cancelled items stop counting against their client.
        greedy[0].cancel()
        await asyncio.sleep(0)
        again, none_refused = submit_as(queue, "greedy", [of_length(bert, 5)])
        assert not none_refused

        runner.open()
        accepted = greedy[1:3] + again + polite + other_frontend + unnamed
        await asyncio.gather(*first, *accepted)

    run_queue(runner, config, body)


def test_the_engine_passes_the_client_to_the_queue(bert: LoadedModel) -> None:
    model, runner = with_runner(bert, hold_first=True)
    config = BatchConfig(max_queued_items=10, max_queued_items_per_client=2)

    async def body(engine: Engine) -> None:
        queue = engine.queues["tiny-bert"]
        blocker = asyncio.ensure_future(engine.pool(embed("the blocking batch")))
        await runner.entered(1)
        two = asyncio.ensure_future(engine.pool(embed("one", "two"), client="ipv4:10.0.0.1:5"))
        await wait_until(lambda: queue.depth == 2, "the client's two items to be queued")
        with pytest.raises(PoolingError) as caught:
            await engine.pool(embed("three"), client="ipv4:10.0.0.1:5")
        assert caught.value.reason == "QUEUE_FULL"
        other = asyncio.ensure_future(engine.pool(embed("a bystander"), client="ipv4:10.0.0.2:7"))
        await wait_until(lambda: queue.depth == 3, "the bystander to be queued")
        runner.open()
        results = await asyncio.gather(blocker, two, other)
        assert [len(r.outputs) for r in results] == [1, 2, 1]

    run_engine([model], body, config)


def _batches_by_client(
    bert: LoadedModel, config: BatchConfig, queued: Sequence[tuple[str, int]]
) -> list[list[str]]:
    """Queue (client, length) items behind a held batch, in order; release; return each
    batch formed after it as the clients of its items."""
    runner = ControlledRunner(bert.runner, hold_first=True)
    owner: dict[int, str] = {}

    async def body(queue: BatchQueue) -> None:
        first = submit(queue, [of_length(bert, 10)])
        await runner.entered(1)
        futures = []
        for client, length in queued:
            sequence = of_length(bert, length)
            owner[id(sequence)] = client
            queued_futures, refused = submit_as(queue, client, [sequence])
            assert not refused
            futures += queued_futures
        runner.open()
        await asyncio.gather(*first, *futures)

    run_queue(runner, config, body)
    return [[owner[id(e)] for e in batch] for batch in runner.batches[1:]]


def test_batches_take_turns_across_clients_when_contended(bert: LoadedModel) -> None:
    """The anchor's client goes round robin and a batch takes each waiting client's items in
    turn, so a client that queued last is not served last."""
    config = BatchConfig(max_batch_size=2)
    queued = [("greedy", 5)] * 6 + [("polite", 5)] * 2 + [("third", 5)]
    batches = _batches_by_client(bert, config, queued)
    assert batches == [
        ["greedy", "polite"],  # greedy anchors; polite's oldest is next in turn
        ["polite", "third"],  # greedy's turn passed to the back
        ["greedy", "greedy"],
        ["greedy", "greedy"],
        ["greedy"],
    ], batches
    # Oldest first without clients would have run polite and third after all of greedy's.


def test_a_late_polite_client_waits_a_batch_not_the_greedy_backlog(bert: LoadedModel) -> None:
    """Lengths that never share a batch: the polite item still runs second, not 51st."""
    config = BatchConfig(max_batch_size=4, min_padding_efficiency=0.8)
    queued = [("greedy", 6)] * 200 + [("polite", 100)]
    batches = _batches_by_client(bert, config, queued)
    assert batches[1] == ["polite"], batches[:3]
    assert all(len(batch) == 4 for batch in batches[2:]), "greedy's batches stay full"


def test_a_newcomer_anchors_next_beside_established_backlogs(bert: LoadedModel) -> None:
    """Two clients with backlogs have each had a turn; a third that comes with one item
    anchors the next batch rather than waiting a batch of each backlog (issue 43, row 8:
    three 1,024-document reranks held a small call 7 s). Then the turns go on in order."""
    config = BatchConfig(max_batch_size=2, min_padding_efficiency=0.9)
    queue = BatchQueue(bert.runner, config)  # never started: batches taken by hand

    def clients(batch: list[Any]) -> list[str]:
        return [item.job.client for item in batch]

    async def body() -> list[list[str]]:
        for client in ("heavy-a", "heavy-b"):
            submit_as(queue, client, [of_length(bert, 6) for _ in range(8)])
        taken = [clients(queue._take_batch()) for _ in range(2)]
        submit_as(queue, "bystander", [of_length(bert, 60)])  # never batched with 6 tokens
        taken += [clients(queue._take_batch()) for _ in range(3)]
        return taken

    taken = asyncio.run(body())
    assert taken == [
        ["heavy-a", "heavy-b"],
        ["heavy-b", "heavy-a"],
        ["bystander"],  # before: after a batch of heavy-a's and one of heavy-b's
        ["heavy-a", "heavy-b"],
        ["heavy-b", "heavy-a"],
    ], taken


def test_a_fold_reduces_each_output_as_its_batch_ends(bert: LoadedModel) -> None:
    """A job's fold runs on each sequence's output in the batch that computed it, and its
    finish gets what the folds returned; a fold that raises fails only its own job."""
    config = BatchConfig(max_batch_size=2)
    runner = ControlledRunner(bert.runner)
    seen: list[int] = []

    def fold(index: int, raw: np.ndarray) -> float:
        seen.append(index)
        return float(raw.sum())

    def broken(index: int, raw: np.ndarray) -> float:
        raise ValueError("a bad fold")

    async def body(queue: BatchQueue) -> tuple[object, object, list[np.ndarray]]:
        loop = asyncio.get_running_loop()
        sequences = [of_length(bert, n) for n in (5, 7, 9, 11, 13)]
        folded = Job([(e, False) for e in sequences], list, loop.create_future(), fold=fold)
        failing = Job([(sequences[0], False)], list, loop.create_future(), fold=broken)
        plain = submit(queue, sequences)
        assert not queue.enqueue([folded, failing])
        outcomes = await asyncio.gather(folded.future, failing.future, return_exceptions=True)
        return outcomes[0], outcomes[1], list(await asyncio.gather(*plain))

    got, error, raws = run_queue(runner, config, body)
    assert got == pytest.approx([float(raw.sum()) for raw in raws], rel=1e-5)
    assert sorted(seen) == [0, 1, 2, 3, 4]
    assert len(runner.batches) >= 3, "five sequences in batches of two: folded batch by batch"
    assert isinstance(error, ValueError)


def _oldest_first(lengths: Sequence[int], config: BatchConfig) -> list[list[int]]:
    """The reference for one client: the oldest item anchors, then the items closest to it in
    length (earliest first on ties) join while the batch stays within budget and dense."""
    waiting = list(range(len(lengths)))
    batches = []
    while waiting:
        window = waiting[: config.lookahead]
        anchor = lengths[window[0]]
        chosen, longest, real = [window[0]], anchor, anchor
        for position in sorted(
            range(1, len(window)), key=lambda p: abs(lengths[window[p]] - anchor)
        ):
            if len(chosen) >= config.max_batch_size:
                break
            n = lengths[window[position]]
            padded = max(longest, n) * (len(chosen) + 1)
            if (
                padded > config.max_batch_tokens
                or real + n < config.min_padding_efficiency * padded
            ):
                continue
            chosen.append(window[position])
            longest, real = max(longest, n), real + n
        batches.append(sorted(chosen))
        waiting = [i for i in waiting if i not in chosen]
    return batches


@pytest.mark.parametrize("client", ["", "ipv4:127.0.0.1:40000"])
def test_one_client_is_batched_oldest_first_as_before(bert: LoadedModel, client: str) -> None:
    """Uncontended, fairness changes nothing: the batches are the oldest-first ones."""
    config = BatchConfig(max_batch_size=8, max_batch_tokens=600, lookahead=64)
    rng = random.Random(5)
    lengths = [rng.randint(3, 90) for _ in range(120)]
    runner = ControlledRunner(bert.runner, hold_first=True)
    sequences = [of_length(bert, n) for n in lengths]

    async def body(queue: BatchQueue) -> None:
        first = submit(queue, [of_length(bert, 10)])
        await runner.entered(1)
        futures, refused = submit_as(queue, client, sequences)
        assert not refused
        runner.open()
        await asyncio.gather(*first, *futures)

    run_queue(runner, config, body)
    index = {id(e): i for i, e in enumerate(sequences)}
    got = [sorted(index[id(e)] for e in batch) for batch in runner.batches[1:]]
    assert got == _oldest_first(lengths, config)


def test_more_clients_than_the_lookahead_are_served_in_turn(bert: LoadedModel) -> None:
    """A step looks at the first `lookahead` clients in turn, one item each at least."""
    config = BatchConfig(max_batch_size=2, lookahead=4)
    queued = [(f"c{k}", 5) for k in range(6)]
    batches = _batches_by_client(bert, config, queued)
    assert batches == [["c0", "c1"], ["c2", "c3"], ["c4", "c5"]], batches


# ---------------------------------------------------------------------------------------
# Timings: one writer per field
# ---------------------------------------------------------------------------------------


def test_the_engine_writes_its_timings_and_leaves_the_total_to_the_caller(
    bert: LoadedModel,
) -> None:
    """tokenize_s from the tokenizer thread, queue_s and inference_s from the batch marks;
    total_s belongs to whoever observes the whole call (the request record), so the
    engine leaves it unset. A model the caller already resolved is the one used."""

    async def one(engine: Engine) -> Timings:
        timings = Timings()
        model = engine.model_named("tiny-bert")
        result = await engine.pool(
            embed("timed", model="not looked up"), timings=timings, model=model
        )
        assert result.model == "tiny-bert"
        return timings

    timings = run_engine([bert], one)
    marks = timings.batches
    assert marks.started is not None and marks.finished is not None
    assert timings.tokenize_s > 0 and timings.inference_s > 0 and timings.queue_s >= 0
    assert timings.queue_s == marks.started - marks.enqueued
    assert timings.inference_s == marks.finished - marks.started
    assert timings.total_s == 0.0
