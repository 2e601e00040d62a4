"""The engine: served models, each with its tokenizer and batching queue.

A request flows one way: resolve the model, validate, tokenize (off the event loop),
queue the sequences, await their raw outputs, apply the heads.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from engine.batch_queue import BatchConfig, BatchQueue, RequestTiming
from engine.loader import LoadedModel
from engine.model_info import ModelInfo
from engine.outputs import PoolResult
from engine.plans import plan_request
from engine.request import PoolRequest
from engine.validation import Limits, unknown_model, validate_request


@dataclass(frozen=True)
class TokenizedText:
    token_ids: list[int]
    tokens: list[str]
    offsets: list[tuple[int, int]]


@dataclass
class Timings:
    """Where a request's time went, in seconds; `batches` holds the raw time.monotonic() marks.

    Inference is the span from the first of the request's batches starting to the last
    ending; queue is the wait before that.
    """

    tokenize_s: float = 0.0
    queue_s: float = 0.0
    inference_s: float = 0.0
    total_s: float = 0.0
    batches: RequestTiming = field(default_factory=RequestTiming)


class Engine:
    def __init__(
        self,
        models: Sequence[LoadedModel],
        limits: Limits | None = None,
        batch_config: BatchConfig | None = None,
        tokenizer_threads: int = 2,
    ) -> None:
        if not models:
            raise ValueError("at least one model is required")
        self.limits = limits or Limits()
        self.batch_config = batch_config or BatchConfig()
        self._models = {model.info.name: model for model in models}
        self._default = models[0].info.name
        self._queues: dict[str, BatchQueue] = {}
        self._tokenizer_pool = ThreadPoolExecutor(tokenizer_threads, thread_name_prefix="tokenize")

    @property
    def model_infos(self) -> list[ModelInfo]:
        return [model.info for model in self._models.values()]

    @property
    def queues(self) -> dict[str, BatchQueue]:
        return self._queues

    async def start(self) -> None:
        for name, model in self._models.items():
            queue = BatchQueue(model.runner, self.batch_config)
            self._queues[name] = queue
            await queue.start()

    async def stop(self) -> None:
        await asyncio.gather(*(queue.stop() for queue in self._queues.values()))
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    def resolve(self, name: str) -> LoadedModel:
        model = self._models.get(name or self._default)
        if model is None:
            raise unknown_model(name, list(self._models))
        return model

    async def pool(
        self, request: PoolRequest, *, deadline: float | None = None, timings: Timings | None = None
    ) -> PoolResult:
        """Run a request; `deadline` is on time.monotonic()'s clock."""
        started = time.monotonic()
        timings = timings if timings is not None else Timings()
        model = self.resolve(request.model)
        validate_request(request, model.info, self.limits)
        loop = asyncio.get_running_loop()
        plan = await loop.run_in_executor(self._tokenizer_pool, plan_request, request, model)
        tokenized = time.monotonic()
        timings.tokenize_s = tokenized - started
        futures = self._queues[model.info.name].submit(plan.work, deadline, timings.batches)
        try:
            raws = await asyncio.gather(*futures)
        finally:
            for future in futures:  # a caller that went away: drop what is still queued
                future.cancel()
        outputs = plan.finish(list(raws))
        batches = timings.batches
        if batches.started is not None and batches.finished is not None:
            timings.queue_s = batches.started - batches.enqueued
            timings.inference_s = batches.finished - batches.started
        timings.total_s = time.monotonic() - started
        return PoolResult(
            request.request_id, model.info.name, request.task, plan.prompt_tokens, outputs
        )

    async def tokenize(
        self, model_name: str, texts: Sequence[str], add_special_tokens: bool = True
    ) -> tuple[ModelInfo, list[TokenizedText]]:
        model = self.resolve(model_name)
        loop = asyncio.get_running_loop()

        def run() -> list[TokenizedText]:
            encodings = model.tokenizer.encode(texts, add_special_tokens=add_special_tokens)
            return [
                TokenizedText(e.input_ids, model.tokenizer.tokens(e.input_ids), e.offsets)
                for e in encodings
            ]

        return model.info, await loop.run_in_executor(self._tokenizer_pool, run)
