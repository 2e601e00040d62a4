"""The request runner: the one path every door's requests take to the engine.

gRPC, the HTTP routes (OpenAI, vLLM, Cohere, TEI) and offline batch jobs each parse their
wire format into engine requests, call `RequestRunner`, and render the engine's result
themselves. The runner owns what they share: readiness, telemetry (metrics labelled with
the door's protocol and its own status), deadlines, cancellation and the failure path, so
a door never sees an exception other than PoolingError. The timings travel back with the
result, each field written once.

Every operation takes that one path (`_run`): Pool, Rerank, Tokenize, decode and the model
list alike. The model a call names is resolved there, once; a door neither checks
readiness nor resolves the model itself, and reads what it needs of the model from what
the runner hands its `render`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, overload

from pooling_server.engine.errors import ErrorKind, PoolingError, clip, internal_error
from pooling_server.engine.models.model_info import ModelInfo
from pooling_server.engine.models.served import ServedModel
from pooling_server.engine.requests.output_size import ResponseBudget
from pooling_server.engine.requests.outputs import PoolResult, RerankResult
from pooling_server.engine.requests.request import PoolRequest, RerankRequest
from pooling_server.engine.requests.validation import Limits
from pooling_server.engine.scheduling.engine import Engine, Timings, Tokenized, TokenizedText
from pooling_server.service.errors import status_label, unavailable
from pooling_server.service.ops.memory import trimmer
from pooling_server.service.ops.telemetry import RequestRecord, Telemetry

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
        # Large Tokenize calls take turns on one thread: each holds ~100 MB while its token
        # arrays and answer exist, which four at once would quadruple. A turn lasts as long
        # as its thread works, even past a caller's deadline.
        self._large_tokenize = ThreadPoolExecutor(1, thread_name_prefix="tokenize-large")

    def ready(self) -> Engine:
        if self.engine is None:
            raise unavailable("the models are still loading; retry shortly")
        return self.engine

    @property
    def limits(self) -> Limits:
        """The engine's limits, for a door parsing a body before its call; the defaults
        while the models load (that call is then answered UNAVAILABLE by `_run`)."""
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

        def run(
            engine: Engine, model: ServedModel | None, timings: Timings
        ) -> Awaitable[PoolResult]:
            assert model is not None
            todo = request if prepare is None else prepare(model.info)
            return engine.pool(
                todo, deadline=call.deadline, timings=timings, client=call.client, model=model
            )

        task = request.task.value if request.task is not None else "none"
        if request.text_1 or request.text_2:
            inputs = lambda: {"text_1": list(request.text_1), "text_2": list(request.text_2)}  # noqa: E731
        else:
            inputs = lambda: {"texts": list(request.texts)}  # noqa: E731
        return await self._run(call, request.request_id, task, request.model, run, inputs, render)

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
        def run(
            engine: Engine, model: ServedModel | None, timings: Timings
        ) -> Awaitable[RerankResult]:
            return engine.rerank(
                request, deadline=call.deadline, timings=timings, client=call.client, model=model
            )

        def inputs() -> dict[str, Any]:
            return {"query": request.query, "documents": list(request.documents)}

        return await self._run(
            call,
            request.request_id,
            "score",
            request.model,
            run,
            inputs,
            render,
            len(request.documents),
        )

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

        async def run(engine: Engine, model: ServedModel | None, timings: Timings) -> R:
            assert model is not None

            def work() -> R:
                started = time.monotonic()
                tokenized = engine.tokenize(model, texts, add_special_tokens, budget, prompt_name)
                timings.tokenize_s = time.monotonic() - started
                try:
                    return render(tokenized)
                finally:
                    if sum(map(len, tokenized.items)) > TRIM_AFTER_TOKENS:
                        del tokenized
                        _trim()  # the pages a long text's lists and arrays took, handed back

            if sum(map(len, texts)) < LARGE_TOKENIZE_CHARS:
                return await _within(call.deadline, asyncio.to_thread(work))
            turn = asyncio.get_running_loop().run_in_executor(self._large_tokenize, work)
            return await _within(call.deadline, turn)  # the wait for a turn counts too

        return await self._run(
            call, "", "tokenize", model, run, lambda: {"texts": list(texts)}, None, len(texts)
        )

    async def decode(
        self, model: str, sequences: Sequence[Sequence[int]], skip_special: bool, call: Call
    ) -> Ran[list[str]]:
        """Token ids back to texts (TEI's /decode): many ids are decoded on a worker thread."""

        async def run(engine: Engine, model: ServedModel | None, timings: Timings) -> list[str]:
            assert model is not None
            if sum(map(len, sequences)) > OFF_LOOP_IDS:
                decoding = asyncio.to_thread(engine.decode, model, sequences, skip_special)
                return await _within(call.deadline, decoding)
            return engine.decode(model, sequences, skip_special)

        return await self._run(call, "", "decode", model, run, lambda: {}, None, len(sequences))

    async def models(self, call: Call, render: Callable[[Engine], R]) -> Ran[R]:
        """The served models (ListModels, /v1/models): `render` reads them, and the limits a
        client plans by, from the engine. No model is named, so none is resolved."""

        async def run(engine: Engine, model: ServedModel | None, timings: Timings) -> Engine:
            return engine

        return await self._run(call, "", "none", None, run, lambda: {}, render, 0)

    async def tokens(
        self, model: str, texts: Sequence[str], add_special_tokens: bool = True
    ) -> list[TokenizedText]:
        """Token counts and spans for a door's rule ahead of its call (Cohere's max_tokens),
        not an operation of its own: not recorded."""
        engine = self.ready()
        served = engine.model_named(model)
        tokenized = await asyncio.to_thread(engine.tokenize, served, texts, add_special_tokens)
        return tokenized.items

    async def _run(
        self,
        call: Call,
        request_id: str,
        task: str,
        model: str | None,
        run: Callable[[Engine, ServedModel | None, Timings], Awaitable[T]],
        inputs: Callable[[], dict[str, Any]],
        render: Callable[[T], Any] | None = None,
        items: int | None = None,
    ) -> Ran[Any]:
        """`items`: what a success counts, when not the result's outputs (a rerank's
        documents). The model is resolved once, here: the engine runs what it names, and
        metrics label every outcome with it (names not served share the label "unknown",
        so clients cannot grow the series). `model` None: the call names none (the model
        list), labelled "none"."""
        record = self.telemetry.open(
            call.rpc, request_id, task, call.headers, call.protocol, inputs
        )
        code, reason, ok, counted, tokens, label = "", "", False, 0, 0, ""
        served: ServedModel | None = None
        try:
            engine = self.ready()
            served = None if model is None else engine.model_named(model)
            label = "none" if served is None else served.info.name
            result = await run(engine, served, record.timings)
            counted, tokens = _size(result)
            counted = counted if items is None else items
            answer = result if render is None else render(result)
            if inspect.isawaitable(answer):  # a large answer, built on a worker thread
                answer = await answer
            code, ok = call.status(None), True
            info = None if served is None else served.info
            return Ran(answer, record.timings, record, info, tokens)
        except PoolingError as error:
            code, reason = call.status(error), error.reason
            raise
        except asyncio.CancelledError:
            code = "CANCELLED"
            raise
        except Exception as exc:
            error = internal_error()
            code, reason = call.status(error), error.reason
            log.exception("request %r failed", clip(request_id, 64))
            raise error from exc
        finally:
            record.finish(code, label or "unknown", counted, tokens, reason, ok)
            if tokens > TRIM_AFTER_TOKENS:  # its token lists are freed: hand their pages back
                asyncio.get_running_loop().run_in_executor(None, _trim)


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
