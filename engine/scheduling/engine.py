"""The engine: served models, each with its tokenizer and batching queue.

A request flows one way. On the event loop: resolve the model and validate. On a
tokenizer thread (intake.py): tokenize and queue the sequences. On a forward worker: run
the batch and apply the heads of every request it completes. Back on the loop: one call
per batch resolves the waiting futures. The loop never tokenizes and never touches an item.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

import numpy as np

from pooling_server.engine.caching.cache import CacheSettings
from pooling_server.engine.errors import ErrorKind, FieldViolation, PoolingError, clip
from pooling_server.engine.inputs.modality import Modality
from pooling_server.engine.inputs.tokenization import Vocabulary
from pooling_server.engine.models.model_info import ModelInfo
from pooling_server.engine.models.served import ServedModel
from pooling_server.engine.requests.character_rules import validate_tokenize
from pooling_server.engine.requests.output_size import ResponseBudget
from pooling_server.engine.requests.outputs import PoolResult, Ranked, RerankResult, Score
from pooling_server.engine.requests.prompt_rules import named_prompt
from pooling_server.engine.requests.request import PoolRequest, RerankRequest
from pooling_server.engine.requests.resolved import Limits, Resolved
from pooling_server.engine.requests.shape_rules import MAX_MODEL_NAME_CHARS
from pooling_server.engine.requests.size_rules import check_tokenize_output
from pooling_server.engine.requests.validation import (
    rerank_error,
    unknown_token_id,
    validate_request,
    validate_rerank,
)
from pooling_server.engine.scheduling.batch_queue import BatchConfig, BatchQueue
from pooling_server.engine.scheduling.engine_client import EngineClient, LocalEngineClient
from pooling_server.engine.scheduling.intake import Entry, Intake
from pooling_server.engine.scheduling.jobs import RequestTiming


@dataclass(frozen=True, slots=True)
class TokenizedText:
    """One text's tokens as arrays: a text of a million tokens is three arrays, not millions
    of Python ints, strings and tuples. Token strings are the vocabulary's
    (ModelTokenizer.vocabulary), looked up by id where an answer is built."""

    token_ids: np.ndarray  # int64, one per token
    offsets: np.ndarray  # int64, (tokens, 2): each token's [start, end) characters
    special_mask: np.ndarray  # bool, True for special tokens

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class Tokenized:
    """Tokenize's result: the model's texts as tokens, with the vocabulary that names them."""

    info: ModelInfo
    inputs: Sequence[str]  # the texts as tokenized (a prompt prepended)
    items: list[TokenizedText]
    vocabulary: Vocabulary


@dataclass
class Timings:
    """Where a request's time went, in seconds; `batches` holds the raw time.monotonic() marks.

    Inference is the span from the first of the request's batches starting to the last
    ending; queue is the wait before that. Each field has one writer, and is read only
    once the request's future has resolved (which orders the writes before the reads):

    - `tokenize_s`: the tokenizer thread, once the request is planned;
    - `batches`: the batching queue (`enqueued` on submit, the span per batch on the
      forward worker), or the engine process's marks copied once by the remote client;
    - `queue_s`, `inference_s`: the engine, on the event loop, once from those marks;
    - `total_s`: whoever observes the whole call (the request record, at its finish);
      the engine leaves it alone.
    """

    tokenize_s: float = 0.0
    queue_s: float = 0.0
    inference_s: float = 0.0
    total_s: float = 0.0
    batches: RequestTiming = field(default_factory=RequestTiming)


class Engine:
    def __init__(
        self,
        models: Sequence[ServedModel],
        limits: Limits | None = None,
        batch_config: BatchConfig | None = None,
        tokenizer_threads: int = 1,
        client: EngineClient | None = None,
        cache: CacheSettings | None = None,
    ) -> None:
        """`client`: where jobs are computed; by default here, which needs LoadedModels.
        `cache`: the result cache's settings (engine/caching; None or 0 MB and no Redis:
        off); its tiers live where the jobs are computed."""
        if not models:
            raise ValueError("at least one model is required")
        self.limits = limits or Limits()
        self.batch_config = batch_config or BatchConfig()
        self._models = {model.info.name: model for model in models}
        self._default = models[0].info.name
        # Each served model's calls in flight and last use: what unloading waits out and
        # eviction orders by (service/repository.py); kept on the loop's thread only.
        self.use: dict[str, ModelUse] = {name: ModelUse() for name in self._models}
        # LoRA adapters routed to, by name: the base model each belongs to. A request picks
        # one by `adapter`, or by naming it as its model (as vLLM's do); its calls in
        # flight are counted in `use` under its name too (an unload drains them).
        self.adapters: dict[str, str] = {}
        for model in models:
            self._route_adapters(model.info)
        self.client = client or LocalEngineClient(models, self.batch_config, cache)  # type: ignore[arg-type]
        # The tokenizer threads and their lanes (intake.py).
        media = any(model.info.accepts_media for model in models)
        caching = cache is not None and cache.enabled
        self._intake = Intake(self.limits, self.client, tokenizer_threads, media, caching)

    @property
    def model_infos(self) -> list[ModelInfo]:
        return [model.info for model in self._models.values()]

    @property
    def tokenizer_threads(self) -> int:
        """Threads tokenizing requests (--tokenizer-threads), as TEI's /info reports them."""
        return sum(thread.name.startswith("tokenize") for thread in self._intake.threads)

    @property
    def queues(self) -> dict[str, BatchQueue]:
        """The batching queues in this process (none when an engine process computes)."""
        return self.client.queues

    def add_model(self, model: ServedModel) -> None:
        """Route calls to a model loaded at run time (its client side already serves it).
        On the event loop."""
        name = model.info.name
        if name in self._models:
            raise ValueError(f"model {name!r} is already served")
        if model.info.accepts_media:
            self._intake.add_media_lane()
        self.use[name] = ModelUse(last_used=time.monotonic())
        self._models[name] = model
        self._route_adapters(model.info)

    def _route_adapters(self, info: ModelInfo) -> None:
        """The adapters a model was loaded with (--adapter), routed with it."""
        for adapter in info.adapters:
            self.add_adapter(adapter, info.name)

    def remove_model(self, name: str) -> ModelUse:
        """Take a model out of routing, on the event loop: a call resolving it from now on
        is refused as unknown, and every call already resolved is counted in the returned
        use (resolving and queueing take no turn of the loop between them), which
        `ModelUse.drained` waits out before the model's queue may stop."""
        self._models.pop(name)
        for adapter in [a for a, base in self.adapters.items() if base == name]:
            del self.adapters[adapter]  # its weights leave with the model's
            self.use.pop(adapter, None)
        if self._default == name and self._models:
            self._default = next(iter(self._models))
        return self.use.pop(name)

    def add_adapter(self, name: str, model: str) -> None:
        """Route calls to a LoRA adapter of `model`, loaded on every engine. On the loop."""
        if name in self._models or name in self.adapters:
            raise ValueError(f"{name!r} already names a served model or adapter")
        self.adapters[name] = model
        self.use[name] = ModelUse(last_used=time.monotonic())

    def remove_adapter(self, name: str) -> ModelUse:
        """Take an adapter out of routing (as remove_model): the use returned counts its
        calls already resolved, which `ModelUse.drained` waits out before its weights go."""
        del self.adapters[name]
        return self.use.pop(name)

    async def start(self) -> None:
        await self.client.start()
        self._intake.start()

    async def stop(self) -> None:
        await self._intake.stop()
        await self.client.stop()

    def serves(self, name: str) -> bool:
        """Whether a call naming `name` resolves to a model now ("": the default)."""
        return name in self._models or (not name and self._default in self._models)

    def model_named(self, name: str) -> ServedModel:
        """The served model a request names ("" for the default). A name is echoed in
        errors, so one past MAX_MODEL_NAME_CHARS is refused before it is looked up."""
        if len(name) > MAX_MODEL_NAME_CHARS:
            description = (
                f"the model name has {len(name)} characters, more than {MAX_MODEL_NAME_CHARS}"
            )
            violation = FieldViolation("model", description, "MODEL_NAME_TOO_LONG")
            raise PoolingError.invalid([violation])
        model = self._models.get(name or self._default)
        if model is None and name in self.adapters:  # an adapter named as the model
            model = self._models.get(self.adapters[name])
        if model is None:
            served = ", ".join(f'"{s}"' for s in self._models)
            reason = "MODEL_NOT_FOUND"
            raise PoolingError(
                ErrorKind.NOT_FOUND,
                reason,
                f'model "{clip(name)}" is not served; served models: {served}',
                (FieldViolation("model", f"unknown model; use one of {served}", reason),),
                metadata={"model": clip(name), "served_models": ",".join(self._models)},
            )
        return model

    async def pool(
        self,
        request: PoolRequest,
        *,
        deadline: float | None = None,
        timings: Timings | None = None,
        client: str = "",
        model: ServedModel | None = None,
    ) -> PoolResult:
        """Run a request; `deadline` is on time.monotonic()'s clock; `client` names who
        asked (a connection or address), for the queue's per-client bound and turns;
        `model`: request.model as the caller already resolved it (`model_named`)."""
        started = time.monotonic()
        model = model or self.model_named(request.model)
        if self.adapters or request.adapter is not None:
            request = self._adapted(request, model)
        resolved = validate_request(request, model.info, self.limits)
        return await self._run(resolved, model, deadline, timings, started, client)

    async def rerank(
        self,
        request: RerankRequest,
        *,
        deadline: float | None = None,
        timings: Timings | None = None,
        client: str = "",
        model: ServedModel | None = None,
    ) -> RerankResult:
        """Score every document against the query (score's 1:N path: pairs through a
        cross-encoder, or cosine similarity of embeddings), then rank them, best first."""
        started = time.monotonic()
        model = model or self.model_named(request.model)
        if self.adapters or request.adapter is not None:
            request = self._adapted(request, model)
        resolved = validate_rerank(request, model.info, self.limits)
        try:
            result = await self._run(resolved, model, deadline, timings, started, client)
        except PoolingError as error:
            raise rerank_error(error) from None
        return _ranking(request, result)

    def _adapted(self, request: R, model: ServedModel) -> R:
        """The request with its LoRA adapter resolved on `model`: named by `adapter`, or by
        the request's model name (an adapter's own name, as vLLM's requests name one). From
        here `model` is the base model's name and `adapter` the adapter's (None: the base
        weights). An adapter `model` lacks is refused by name (ADAPTER_NOT_FOUND)."""
        adapter = request.adapter
        if request.model in self.adapters:
            if adapter is not None and adapter != request.model:
                message = (
                    f'the model name names adapter "{clip(request.model)}" and `adapter` '
                    f'names "{clip(adapter)}"; give one'
                )
                violation = FieldViolation("adapter", message, "ADAPTER_CONFLICT")
                raise PoolingError.invalid([violation])
            adapter = request.model
        if adapter is None:
            return request
        name = model.info.name
        if self.adapters.get(adapter) != name:
            own = sorted(a for a, base in self.adapters.items() if base == name)
            listed = ", ".join(f'"{a}"' for a in own) or "none"
            reason = "ADAPTER_NOT_FOUND"
            raise PoolingError(
                ErrorKind.NOT_FOUND,
                reason,
                f'adapter "{clip(adapter)}" is not loaded on model "{clip(name)}"; its '
                f"adapters: {listed}",
                (FieldViolation("adapter", f"unknown adapter; {name}'s: {listed}", reason),),
                metadata={"adapter": clip(adapter), "model": clip(name)},
            )
        return replace(request, model=name, adapter=adapter)

    async def _run(
        self,
        request: Resolved,
        model: ServedModel,
        deadline: float | None,
        timings: Timings | None,
        started: float,
        client: str = "",
    ) -> PoolResult:
        """Tokenize, queue and compute a validated request."""
        timings = timings if timings is not None else Timings()
        use = self.use.get(model.info.name) or ModelUse()
        use.in_flight += 1
        use.last_used = started
        adapter = request.request.adapter
        if adapter is not None:  # its own count too, which its unload drains
            use = _Both(use, self.use.get(adapter) or ModelUse())
            use.second.in_flight += 1
            use.second.last_used = started
        future: asyncio.Future[PoolResult] = asyncio.get_running_loop().create_future()
        intake = Entry(request, model, deadline, timings, future, started, client)
        self._intake.put(intake)
        try:
            result = await future  # a cancelled caller cancels the future: its items are dropped
        except asyncio.CancelledError:
            if intake.job is not None:
                self.client.cancel(intake.job)
            future = intake = None  # type: ignore[assignment]  # see below
            raise
        except BaseException:
            # The future keeps the error it raised, and the error's traceback keeps this
            # frame: forget the future here, or that cycle holds the request until a gc.
            future = intake = None  # type: ignore[assignment]
            raise
        finally:
            use.left()
        batches = timings.batches  # their writers are done: the future resolved
        if batches.started is not None and batches.finished is not None:
            timings.queue_s = batches.started - batches.enqueued
            timings.inference_s = batches.finished - batches.started
        if intake.job is not None and intake.job.cached:
            result = replace(result, cached_tokens=intake.job.cached)
        return result

    def tokenize(
        self,
        model: ServedModel,
        texts: Sequence[str],
        add_special_tokens: bool = True,
        budget: ResponseBudget | None = None,
        prompt_name: str | None = None,
    ) -> Tokenized:
        """Tokenize's work, blocking: the runner calls it on a worker thread. `budget`: the
        answer's door (its cap, its cost per token), bounded before tokenizing and again,
        exactly as counted, before the answer is built. `prompt_name`: the model's prompt
        put before each text (TEI's)."""
        budget = budget or self.limits.response
        if prompt_name is not None:
            prompt = named_prompt(prompt_name, model.info)
            texts = [prompt + text for text in texts]
        validate_tokenize(texts, model.info, self.limits, budget)
        tokenizer = model.tokenizer
        items = [
            TokenizedText(ids, offsets, mask)
            for ids, offsets, mask in tokenizer.token_arrays(texts, add_special_tokens)
        ]
        lengths = [(len(item), len(text)) for item, text in zip(items, texts, strict=True)]
        check_tokenize_output(lengths, self.limits, budget)
        return Tokenized(model.info, texts, items, tokenizer.vocabulary())

    def decode(
        self, model: ServedModel, sequences: Sequence[Sequence[int]], skip_special_tokens: bool
    ) -> list[str]:
        """Token id sequences back to texts (TEI's /decode), blocking like `tokenize`; an id
        outside the vocabulary is refused, naming its sequence."""
        tokenizer = model.tokenizer
        vocabulary = tokenizer.vocab_size
        for n, sequence in enumerate(sequences):
            bad = next((i for i in sequence if not 0 <= i < vocabulary), None)
            if bad is not None:
                raise unknown_token_id(f"ids[{n}]", bad, vocabulary)
        return tokenizer.decode(sequences, skip_special_tokens)


R = TypeVar("R", PoolRequest, RerankRequest)


@dataclass(slots=True)
class _Both:
    """A call on an adapter: counted in its model's use and in its adapter's."""

    first: ModelUse
    second: ModelUse

    def left(self) -> None:
        self.first.left()
        self.second.left()


@dataclass(slots=True)
class ModelUse:
    """One served model's pool and rerank calls in flight, and when one last came: an
    unload waits for none in flight, and eviction never picks a model with any."""

    in_flight: int = 0
    last_used: float = 0.0
    _idle: asyncio.Event | None = None

    def left(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0 and self._idle is not None:
            self._idle.set()

    async def drained(self) -> None:
        """Once no call is in flight (on the loop, after the model left routing)."""
        if self.in_flight:
            self._idle = asyncio.Event()
            await self._idle.wait()


def _modality(item: object) -> Modality:
    return Modality.TEXT if isinstance(item, str) else Modality(item.modality)  # type: ignore[attr-defined]


def _ranking(request: RerankRequest, result: PoolResult) -> RerankResult:
    """Documents by decreasing score, ties in input order; the best top_n (0: all)."""
    scores = np.array([o.value for o in result.outputs if isinstance(o, Score)], dtype=np.float32)
    order = np.argsort(-scores, kind="stable")[: request.top_n or None]
    if request.items:  # a two-tower model's documents: each says what it was
        items = request.items
        ranking = [Ranked(int(i), float(scores[i]), _modality(items[int(i)])) for i in order]
    else:
        ranking = [Ranked(int(i), float(scores[i])) for i in order]
    return RerankResult(
        result.request_id, result.model, result.prompt_tokens, ranking, result.cached_tokens
    )
