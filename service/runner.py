"""The request runner: the one path every door's requests take to the engine.

gRPC, the HTTP routes (OpenAI, vLLM, Cohere, TEI) and offline batch jobs each parse their
wire format into engine requests, call `RequestRunner`, and render the engine's result
themselves. The runner owns what they share: readiness, telemetry (metrics labelled with
the door's protocol and its own status), deadlines, cancellation and the failure path, so
a door never sees an exception other than PoolingError. The timings travel back with the
result, each field written once.

Every operation records its call the one way (`_Outcome`): Pool, Rerank, Tokenize, decode
and the model list alike, each calling the engine straight from its own body. The model a
call names is resolved there, once; a door neither checks readiness nor resolves the
model itself, and reads what it needs of the model from what the runner hands its
`render`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

from pooling_server.engine.errors import ErrorKind, PoolingError, clip, internal_error
from pooling_server.engine.models.model_info import ModelInfo
from pooling_server.engine.models.served import ServedModel
from pooling_server.engine.requests.output_size import ResponseBudget
from pooling_server.engine.requests.outputs import PoolResult, RerankResult
from pooling_server.engine.requests.request import PoolRequest, RerankRequest
from pooling_server.engine.requests.resolved import Limits
from pooling_server.engine.scheduling.engine import Engine, Timings, Tokenized, TokenizedText
from pooling_server.service.errors import status_label, unavailable
from pooling_server.service.ops.memory import trimmer
from pooling_server.service.ops.telemetry import RequestRecord, Telemetry

if TYPE_CHECKING:
    from pooling_server.service.cache_control import CacheControl
    from pooling_server.service.repository import ModelManager

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class Call:
    """What the runner needs to know of a call, whatever door it came through.

    `rpc` names the operation in metrics (Pool, Rerank, ...); `headers` carry the caller's
    trace context; `deadline` is on time.monotonic()'s clock; `client` identifies the
    caller (a connection or an address), for the queue's fairness between clients.
    `statuses` gives the status a door answers an error with, where it is not
    service/errors.py's for its protocol (TEI's 422 for a bad field), so that metrics
    and logs record what the client actually got.
    """

    protocol: str
    rpc: str
    headers: Iterable[tuple[str, str | bytes]] = ()
    deadline: float | None = None
    client: str = ""
    statuses: Callable[[PoolingError], int | str] | None = None

    def status(self, error: PoolingError | None) -> str:
        """The status label of an outcome (None: success)."""
        if error is not None and self.statuses is not None:
            return str(self.statuses(error))
        return status_label(self.protocol, None if error is None else error.kind)


@dataclass(frozen=True)
class Ran(Generic[T]):
    """A result with where its time went, the record that observed it, the model the call
    was resolved to (None for a call that names none: the model list), and its prompt
    tokens (for the timing trailers, whatever form the door's answer took)."""

    result: T
    timings: Timings
    record: RequestRecord
    info: ModelInfo | None = None
    prompt_tokens: int = 0


class RequestRunner:
    def __init__(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry
        self.engine: Engine | None = None  # set once the models are loaded
        # Models loaded at run time and on demand (service/repository.py); None: only
        # those loaded at start are served.
        self.repository: ModelManager | None = None
        # Large Tokenize calls take turns on one thread: each holds ~100 MB while its token
        # arrays and answer exist, which four at once would quadruple. A turn lasts as long
        # as its thread works, even past a caller's deadline.
        self._large_tokenize = ThreadPoolExecutor(1, thread_name_prefix="tokenize-large")
        # The result cache's scope and bypass, read from each call (service/cache_control.py);
        # None: the cache is off, and calls are passed as they are.
        self.cache: CacheControl | None = None

    def ready(self) -> Engine:
        if self.engine is None:
            raise unavailable("the models are still loading; retry shortly")
        return self.engine

    async def on_demand(
        self,
        outcome: _Outcome,
        engine: Engine,
        model: str,
        deadline: float | None,
        unknown: PoolingError,
    ) -> ServedModel:
        """The unknown-model branch: a call naming a model the engine does not serve. A
        repository model is loaded (or its load shared) within the call's deadline, then
        resolved; any other name is refused as it was (`unknown`). A served model's call
        never comes here, so the repository adds no step to its walk."""
        if self.repository is None or unknown.reason != "MODEL_NOT_FOUND":
            raise unknown
        await self.repository.ensure(model, deadline)
        return outcome.resolve(engine, model)

    @property
    def limits(self) -> Limits:
        """The engine's limits, for a door parsing a body before its call; the defaults
        while the models load (that call is then answered UNAVAILABLE by the runner)."""
        engine = self.engine
        return _DEFAULT_LIMITS if engine is None else engine.limits

    @property
    def model_infos(self) -> list[ModelInfo]:
        return self.ready().model_infos

    @overload
    async def pool(
        self,
        request: PoolRequest,
        call: Call,
        *,
        prepare: Callable[[ModelInfo], PoolRequest] | None = None,
    ) -> Ran[PoolResult]: ...
    @overload
    async def pool(
        self,
        request: PoolRequest,
        call: Call,
        render: Callable[[PoolResult], R],
        prepare: Callable[[ModelInfo], PoolRequest] | None = None,
    ) -> Ran[R]: ...
    async def pool(
        self,
        request: PoolRequest,
        call: Call,
        render: Callable[[PoolResult], Any] | None = None,
        prepare: Callable[[ModelInfo], PoolRequest] | None = None,
    ) -> Ran[Any]:
        """`render`: the door's answer built from the result inside the recorded call, so
        that a refusal while rendering (an answer too large to send) is what metrics count.
        `prepare`: the door's last word on the request once its model is resolved (Cohere's
        input_type becomes that model's prompt), so that the door never resolves it itself."""
        task = request.task.value if request.task is not None else "none"
        with _Outcome(self, call, request.request_id, task, _pool_inputs(request)) as outcome:
            engine = self.ready()
            try:
                model = outcome.resolve(engine, request.model)
            except PoolingError as unknown:
                model = await self.on_demand(outcome, engine, request.model, call.deadline, unknown)
            if prepare is not None:
                request = prepare(model.info)
            if self.cache is not None:
                request = self.cache.apply(request, call.headers)
            result = await engine.pool(
                request,
                deadline=call.deadline,
                timings=outcome.timings,
                client=call.client,
                model=model,
            )
            return await outcome.answer(result, render)

    @overload
    async def rerank(self, request: RerankRequest, call: Call) -> Ran[RerankResult]: ...
    @overload
    async def rerank(
        self, request: RerankRequest, call: Call, render: Callable[[RerankResult], R]
    ) -> Ran[R]: ...
    async def rerank(
        self,
        request: RerankRequest,
        call: Call,
        render: Callable[[RerankResult], Any] | None = None,
    ) -> Ran[Any]:
        def inputs() -> dict[str, Any]:
            return {"query": request.query, "documents": list(request.documents)}

        items = len(request.documents)
        with _Outcome(self, call, request.request_id, "score", inputs, items) as outcome:
            engine = self.ready()
            try:
                model = outcome.resolve(engine, request.model)
            except PoolingError as unknown:
                model = await self.on_demand(outcome, engine, request.model, call.deadline, unknown)
            if self.cache is not None:
                request = self.cache.apply(request, call.headers)
            result = await engine.rerank(
                request,
                deadline=call.deadline,
                timings=outcome.timings,
                client=call.client,
                model=model,
            )
            return await outcome.answer(result, render)

    async def tokenize(
        self,
        model: str,
        texts: Sequence[str],
        call: Call,
        render: Callable[[Tokenized], R],
        add_special_tokens: bool = True,
        budget: ResponseBudget | None = None,
        prompt_name: str | None = None,
    ) -> Ran[R]:
        """Tokenize (gRPC's, TEI's /tokenize). Tokens and the door's answer (`render`) are
        both made on a worker thread: a text of a million tokens never holds the loop.
        `budget`: the door's cap and cost per token (gRPC's by default); `prompt_name`: the
        model's prompt before each text."""
        inputs = lambda: {"texts": list(texts)}  # noqa: E731
        with _Outcome(self, call, "", "tokenize", inputs, len(texts)) as outcome:
            engine = self.ready()
            try:
                served = outcome.resolve(engine, model)
            except PoolingError as unknown:
                served = await self.on_demand(outcome, engine, model, call.deadline, unknown)
            timings = outcome.timings

            def work() -> R:
                started = time.monotonic()
                tokenized = engine.tokenize(served, texts, add_special_tokens, budget, prompt_name)
                timings.tokenize_s = time.monotonic() - started
                try:
                    return render(tokenized)
                finally:
                    if sum(map(len, tokenized.items)) > TRIM_AFTER_TOKENS:
                        del tokenized
                        _trim()  # the pages a long text's lists and arrays took, handed back

            if sum(map(len, texts)) < LARGE_TOKENIZE_CHARS:
                answer = await _within(call.deadline, asyncio.to_thread(work))
            else:  # the wait for a turn counts too
                turn = asyncio.get_running_loop().run_in_executor(self._large_tokenize, work)
                answer = await _within(call.deadline, turn)
            return await outcome.answer(answer, None)

    async def decode(
        self, model: str, sequences: Sequence[Sequence[int]], skip_special: bool, call: Call
    ) -> Ran[list[str]]:
        """Token ids back to texts (TEI's /decode): many ids are decoded on a worker thread."""
        with _Outcome(self, call, "", "decode", dict, len(sequences)) as outcome:
            engine = self.ready()
            try:
                served = outcome.resolve(engine, model)
            except PoolingError as unknown:
                served = await self.on_demand(outcome, engine, model, call.deadline, unknown)
            if sum(map(len, sequences)) > OFF_LOOP_IDS:
                decoding = asyncio.to_thread(engine.decode, served, sequences, skip_special)
                texts = await _within(call.deadline, decoding)
            else:
                texts = engine.decode(served, sequences, skip_special)
            return await outcome.answer(texts, None)

    async def models(self, call: Call, render: Callable[[Engine], R]) -> Ran[R]:
        """The served models (ListModels, /v1/models): `render` reads them, and the limits a
        client plans by, from the engine. No model is named, so none is resolved."""
        with _Outcome(self, call, "", "none", dict, 0) as outcome:
            engine = self.ready()
            outcome.label = "none"
            return await outcome.answer(engine, render)

    async def tokens(
        self, model: str, texts: Sequence[str], add_special_tokens: bool = True
    ) -> list[TokenizedText]:
        """Token counts and spans for a door's rule ahead of its call (Cohere's max_tokens),
        not an operation of its own: not recorded."""
        engine = self.ready()
        served = engine.model_named(model)
        tokenized = await asyncio.to_thread(engine.tokenize, served, texts, add_special_tokens)
        return tokenized.items


class _Outcome:
    """One call as the runner records it, whatever its operation: its record opened, its
    model resolved once (`resolve`), its answer rendered inside the call (`answer`), and on
    leaving its `with` block its outcome labelled, counted and logged once. Any exception
    other than a PoolingError leaves as INTERNAL; the door never sees another.

    `items`: what a success counts, when not the result's outputs (a rerank's documents).
    Metrics label every outcome with the resolved model (names not served share the label
    "unknown", so clients cannot grow the series); a call that names none, "none"."""

    def __init__(
        self,
        runner: RequestRunner,
        call: Call,
        request_id: str,
        task: str,
        inputs: Callable[[], dict[str, Any]],
        items: int | None = None,
    ) -> None:
        self.runner, self.call, self.request_id, self.items = runner, call, request_id, items
        self.record = runner.telemetry.open(
            call.rpc, request_id, task, call.headers, call.protocol, inputs
        )
        self.timings = self.record.timings
        self.code, self.reason, self.label = "", "", ""
        self.ok, self.counted, self.tokens = False, 0, 0
        self.info: ModelInfo | None = None

    def resolve(self, engine: Engine, model: str) -> ServedModel:
        """The model the call names (or the default one), resolved once."""
        served = engine.model_named(model)
        self.info, self.label = served.info, served.info.name
        return served

    async def answer(self, result: T, render: Callable[[T], Any] | None) -> Ran[Any]:
        """The door's answer (`render`, awaited when built on a worker thread), counted."""
        counted, self.tokens = _size(result)
        self.counted = counted if self.items is None else self.items
        answer = result if render is None else render(result)
        if inspect.isawaitable(answer):  # a large answer, built on a worker thread
            answer = await answer
        self.code, self.ok = self.call.status(None), True
        return Ran(answer, self.timings, self.record, self.info, self.tokens)

    def __enter__(self) -> _Outcome:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: Any
    ) -> None:
        try:
            if isinstance(error, PoolingError):
                self.code, self.reason = self.call.status(error), error.reason
            elif isinstance(error, asyncio.CancelledError):
                self.code = "CANCELLED"
            elif isinstance(error, Exception):
                failure = internal_error()
                self.code, self.reason = self.call.status(failure), failure.reason
                log.error(
                    "request %r failed", clip(self.request_id, 64), exc_info=(kind, error, trace)
                )
                raise failure from error
        finally:
            self.record.finish(
                self.code, self.label or "unknown", self.counted, self.tokens, self.reason, self.ok
            )
            if self.tokens > TRIM_AFTER_TOKENS:  # its token lists are freed: hand their pages back
                asyncio.get_running_loop().run_in_executor(None, _trim)


def _pool_inputs(request: PoolRequest) -> Callable[[], dict[str, Any]]:
    """A Pool call's inputs, for telemetry, read only if it logs them."""
    if request.text_1 or request.text_2:
        return lambda: {"text_1": list(request.text_1), "text_2": list(request.text_2)}
    return lambda: {"texts": list(request.texts)}


_DEFAULT_LIMITS = Limits()


async def _within(deadline: float | None, work: Awaitable[T]) -> T:
    """`work`, refused as DEADLINE_EXCEEDED once the call's deadline passes (the worker
    thread finishes on its own; its answer is dropped)."""
    if deadline is None:
        return await work
    try:
        return await asyncio.wait_for(work, max(0.0, deadline - time.monotonic()))
    except TimeoutError:
        raise PoolingError(
            ErrorKind.DEADLINE_EXCEEDED,
            "DEADLINE_EXCEEDED",
            "the deadline passed while the texts were tokenized",
        ) from None


# Decodes of more ids than this run on a worker thread.
OFF_LOOP_IDS = 65_536
# A call of more tokens than this gives the allocator's free pages back when done: three
# reranks of 1,024 documents of 512 tokens left +150 MB of token lists' pages held.
TRIM_AFTER_TOKENS = 100_000
LARGE_TOKENIZE_CHARS = 1_000_000  # about 250k tokens and more: one such call at a time
_trim = trimmer()


def _size(result: object) -> tuple[int, int]:
    """(items, prompt tokens) of a result, for its metrics."""
    if isinstance(result, PoolResult):
        return len(result.outputs), result.prompt_tokens
    if isinstance(result, RerankResult):
        return 0, result.prompt_tokens
    return 0, 0
