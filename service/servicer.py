"""PoolingService: translate, delegate to the engine, translate back."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import grpc
from google.protobuf.message import Message
from google.rpc import status_pb2

from engine.engine import Engine
from engine.errors import ErrorKind, FieldViolation, PoolingError, clip, internal_error
from engine.output_size import ResponseBudget
from engine.validation import MAX_REQUEST_ID_BYTES, output_too_large, request_id_too_long
from service import convert
from service.errors import GRPC_CODES, to_grpc_status, to_status_proto, unavailable
from service.handlers import Malformed
from service.proto import pooling_pb2 as pb
from service.proto import pooling_pb2_grpc
from service.stream_limit import InflightLimit
from service.telemetry import RequestRecord, Telemetry
from service.version import server_version

log = logging.getLogger(__name__)

_Request = TypeVar("_Request", pb.PoolRequest, pb.RerankRequest)
_Response = TypeVar("_Response", pb.PoolResponse, pb.RerankResponse)


def _deadline(context: grpc.aio.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


class PoolingServicer(pooling_pb2_grpc.PoolingServiceServicer):
    def __init__(self, telemetry: Telemetry, max_stream_inflight: int = 256) -> None:
        self.engine: Engine | None = None  # set once the models are loaded
        self.telemetry = telemetry
        self.max_stream_inflight = max_stream_inflight

    def _ready_engine(self) -> Engine:
        if self.engine is None:
            raise unavailable("the models are still loading; retry shortly")
        return self.engine

    async def run_pool(
        self,
        request: pb.PoolRequest,
        record: RequestRecord,
        deadline: float | None,
        client: str = "",
        budget: ResponseBudget | None = None,
    ) -> pb.PoolResponse:
        """Run one request; every failure comes out as a PoolingError. `client`: who asked
        (a gRPC peer, an HTTP address), so one client cannot take the whole queue.
        `budget`: the door's bound on the answer, where it is not gRPC's (the HTTP API's)."""

        async def run(engine: Engine) -> tuple[pb.PoolResponse, int, int, str]:
            pool_request = convert.request_from_proto(request)
            if budget is not None:
                pool_request = dataclasses.replace(pool_request, response_budget=budget)
            result = await engine.pool(
                pool_request,
                deadline=deadline,
                timings=record.timings,
                client=client,
            )
            response = convert.response_to_proto(result)
            if budget is None:
                _check_sendable(response, engine.limits.response)
            return response, len(result.outputs), result.prompt_tokens, result.model

        return await self._observed(request, record, run)

    async def run_rerank(
        self,
        request: pb.RerankRequest,
        record: RequestRecord,
        deadline: float | None,
        client: str = "",
    ) -> pb.RerankResponse:
        """Rank the documents; every failure comes out as a PoolingError."""

        async def run(engine: Engine) -> tuple[pb.RerankResponse, int, int, str]:
            result = await engine.rerank(
                convert.rerank_request_from_proto(request),
                deadline=deadline,
                timings=record.timings,
                client=client,
            )
            response = convert.rerank_response_to_proto(result, request)
            return response, len(request.documents), result.prompt_tokens, result.model

        return await self._observed(request, record, run)

    async def _observed(
        self,
        request: pb.PoolRequest | pb.RerankRequest,
        record: RequestRecord,
        run: Callable[[Engine], Awaitable[tuple[_Response, int, int, str]]],
    ) -> _Response:
        """`run` on the engine, its outcome recorded: (response, items, tokens, model)."""
        code, reason, items, tokens, model = "OK", "", 0, 0, ""
        try:
            response, items, tokens, model = await run(self._ready_engine())
            return response
        except PoolingError as error:
            code, reason = GRPC_CODES[error.kind].name, error.reason
            raise
        except asyncio.CancelledError:
            code = "CANCELLED"
            raise
        except Exception as exc:
            code, reason = "INTERNAL", "INTERNAL_ERROR"
            log.exception("request %r failed", clip(request.request_id, 64))
            raise internal_error() from exc
        finally:
            record.finish(code, model or self._model_label(request.model), items, tokens, reason)

    def _model_label(self, name: str) -> str:
        """The served name; unknown names share one label so clients cannot grow the series."""
        if self.engine is None:
            return "unknown"
        try:
            return self.engine.resolve(name).info.name
        except PoolingError:
            return "unknown"

    async def Pool(
        self, request: pb.PoolRequest | Malformed, context: grpc.aio.ServicerContext
    ) -> pb.PoolResponse:
        return await self._unary("Pool", request, context, self.run_pool)

    async def Rerank(
        self, request: pb.RerankRequest | Malformed, context: grpc.aio.ServicerContext
    ) -> pb.RerankResponse:
        return await self._unary("Rerank", request, context, self.run_rerank)

    async def _unary(
        self,
        rpc: str,
        request: _Request | Malformed,
        context: grpc.aio.ServicerContext,
        run: Callable[[_Request, RequestRecord, float | None, str], Awaitable[_Response]],
    ) -> _Response:
        """A recorded unary call: errors as rich statuses, timings in the trailers."""
        try:
            if type(request) is Malformed:
                raise request.error()
            record = self.telemetry.begin(rpc, request, context)  # type: ignore[arg-type]
            # The peer names the connection ("ipv4:host:port"): the queue's client.
            peer = context.peer()
            response = await run(request, record, _deadline(context), peer)  # type: ignore[arg-type]
        except PoolingError as error:
            await context.abort_with_status(to_grpc_status(error))
            raise  # unreachable: abort raises
        prompt_tokens = response.usage.prompt_tokens  # type: ignore[attr-defined]
        context.set_trailing_metadata(record.trailing_metadata(prompt_tokens))
        return response

    async def PoolStream(
        self,
        request_iterator: AsyncIterator[pb.PoolStreamRequest | Malformed],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.PoolStreamResponse]:
        """Requests run concurrently; each response is sent as soon as it is ready.

        The reader stops pulling requests while `max_stream_inflight` items are
        unanswered, so a fast client cannot make the server buffer without bound. Every
        response counts, in-band errors too: one per message, an input request's weight.
        """
        limit = InflightLimit(self.max_stream_inflight)
        done: asyncio.Queue[tuple[pb.PoolStreamResponse, int] | None] = asyncio.Queue()
        deadline = _deadline(context)
        peer = context.peer()  # the queue's client: every stream of a connection shares it
        seen: set[str] = set()
        running: set[asyncio.Task[None]] = set()

        async def run(request: pb.PoolRequest, weight: int) -> None:
            record = self.telemetry.begin("PoolStream", request, context)
            try:
                response = pb.PoolStreamResponse(
                    request_id=request.request_id,
                    response=await self.run_pool(request, record, deadline, peer),
                )
            except PoolingError as error:
                response = pb.PoolStreamResponse(
                    request_id=request.request_id, error=to_status_proto(error)
                )
            await done.put((response, weight))

        async def read() -> None:
            """Errors about a message itself are answered in band, and the stream goes on."""
            index = -1
            async for message in request_iterator:
                index += 1
                if type(message) is Malformed:
                    # An in-band error is a response like any other: it takes a slot, so a
                    # client that writes garbage and never reads is held back all the same.
                    await limit.acquire(1)
                    error = to_status_proto(message.error(f"messages[{index}]"))
                    # One refused on the wire for its size answers to its id, if usable.
                    request_id = message.request_id
                    if _stream_id_error(request_id, seen, index) is None:
                        seen.add(request_id)
                    else:
                        request_id = ""
                    answer = pb.PoolStreamResponse(request_id=request_id, error=error)
                    await done.put((answer, 1))
                    continue
                request = message.request
                weight = _weight(request)
                await limit.acquire(weight)
                error = _stream_id_error(request.request_id, seen, index)
                if error is not None:
                    await done.put((pb.PoolStreamResponse(error=error), weight))
                    continue
                seen.add(request.request_id)
                task = asyncio.create_task(run(request, weight))
                running.add(task)
                task.add_done_callback(running.discard)
            await asyncio.gather(*running)
            await done.put(None)

        reader = asyncio.create_task(read())
        try:
            while True:
                if reader.done():
                    reader.result()  # re-raise a failed read; otherwise drain what is left
                    item = await done.get()
                else:
                    getter = asyncio.ensure_future(done.get())
                    await asyncio.wait({getter, reader}, return_when=asyncio.FIRST_COMPLETED)
                    if not getter.done():
                        getter.cancel()
                        continue
                    item = getter.result()
                if item is None:
                    return
                response, weight = item
                yield response
                limit.release(weight)
        finally:
            reader.cancel()
            for task in list(running):
                task.cancel()

    async def ListModels(
        self, request: pb.ListModelsRequest | Malformed, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        try:
            if type(request) is Malformed:
                raise request.error()
            engine = self._ready_engine()
        except PoolingError as error:
            await context.abort_with_status(to_grpc_status(error))
            raise
        return pb.ListModelsResponse(
            models=[convert.model_card(info) for info in engine.model_infos],
            max_client_batch_size=engine.limits.max_client_batch_size,
            max_stream_inflight=self.max_stream_inflight,
            server_version=server_version(),
        )

    async def Tokenize(
        self, request: pb.TokenizeRequest | Malformed, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        try:
            if type(request) is Malformed:
                raise request.error()
            engine = self._ready_engine()
            add_special = (
                request.add_special_tokens if request.HasField("add_special_tokens") else True
            )
            info, items = await engine.tokenize(request.model, request.texts, add_special)
        except PoolingError as error:
            await context.abort_with_status(to_grpc_status(error))
            raise
        response = convert.tokenize_response(info, items)
        try:
            _check_sendable(response, engine.limits.response)
        except PoolingError as error:
            await context.abort_with_status(to_grpc_status(error))
            raise
        return response


def _check_sendable(response: Message, budget: ResponseBudget) -> None:
    """The real size, where the estimate let an answer through (sparse weights, say): a
    clear refusal rather than gRPC's own failure at send."""
    size = response.ByteSize()
    if size > budget.max_bytes:
        raise output_too_large("", size, budget)


def _weight(request: pb.PoolRequest) -> int:
    case = request.WhichOneof("input")
    if case == "score":
        return max(len(request.score.text_1), len(request.score.text_2), 1)
    return max(len(getattr(request, case).texts), 1) if case else 1


def _stream_id_error(request_id: str, seen: set[str], index: int) -> status_pb2.Status | None:
    """An error about the id of stream message `index`: missing, too long, or repeated.

    Answered with an empty request_id (see PoolStreamResponse), so the client never takes
    it for the answer to the request that first used the id.
    """
    too_long = request_id_too_long(request_id)
    if request_id and request_id not in seen and not too_long:
        return None
    metadata = {}
    if not request_id:
        reason, problem = "REQUEST_ID_MISSING", "request_id is required on a stream"
    elif too_long:
        reason = "REQUEST_ID_TOO_LONG"
        problem = f"request_id has more than {MAX_REQUEST_ID_BYTES} bytes"
    else:
        reason, problem = "REQUEST_ID_DUPLICATE", "request_id repeats an earlier request_id"
        metadata["request_id"] = request_id
    return to_status_proto(
        PoolingError(
            ErrorKind.INVALID_ARGUMENT,
            reason,
            problem,
            (FieldViolation(f"messages[{index}].request.request_id", problem, reason),),
            metadata=metadata,
        )
    )
