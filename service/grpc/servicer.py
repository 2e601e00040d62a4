"""PoolingService: the gRPC door over the request runner (service/runner.py).

Each method parses its message into engine types (service/grpc/convert.py), runs it through
the runner, which owns readiness, telemetry, deadlines and the failure path, and renders
the result back as protobuf, with its timings in the trailing metadata. What is gRPC's
own stays here: rich statuses, PoolStream's flow control and its stream-id rule.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import grpc
from google.protobuf.message import Message

from pooling_server.engine.errors import PoolingError
from pooling_server.engine.requests.output_size import ResponseBudget
from pooling_server.engine.requests.outputs import OFF_LOOP_VALUES, PoolResult, values_in
from pooling_server.engine.requests.request import PoolRequest
from pooling_server.engine.requests.shape_rules import stream_request_id_error
from pooling_server.engine.requests.size_rules import output_too_large
from pooling_server.engine.scheduling.engine import Engine
from pooling_server.service.errors import to_grpc_status, to_status_proto
from pooling_server.service.grpc import convert
from pooling_server.service.grpc.handlers import Malformed
from pooling_server.service.grpc.repository import add_adapters, add_states
from pooling_server.service.grpc.stream_limit import InflightLimit
from pooling_server.service.ops.version import server_version
from pooling_server.service.proto import pooling_pb2 as pb
from pooling_server.service.proto import pooling_pb2_grpc
from pooling_server.service.runner import Call, RequestRunner

_Message = TypeVar("_Message", bound=Message)
_Built = TypeVar("_Built")
# Large answers are built one at a time, on one thread: each costs its message and its wire
# bytes beside the result while it is built, and each thread its own malloc arena (16
# answers of 14 MB built side by side on the default executor's threads: front end +600 MB).
_BUILDER = ThreadPoolExecutor(1, thread_name_prefix="answer-builder")


def _deadline(context: grpc.aio.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


def _call(rpc: str, context: grpc.aio.ServicerContext, deadline: float | None) -> Call:
    # The peer names the connection ("ipv4:host:port"): the queue's client, so one
    # connection (all of its streams together) cannot take the whole queue.
    return Call(
        protocol="grpc",
        rpc=rpc,
        headers=context.invocation_metadata() or (),
        deadline=deadline,
        client=context.peer(),
    )


class PoolingServicer(pooling_pb2_grpc.PoolingServiceServicer):
    def __init__(self, runner: RequestRunner, max_stream_inflight: int = 256) -> None:
        self.runner = runner
        self.max_stream_inflight = max_stream_inflight

    async def _in_turn(self, build: Callable[[], _Built]) -> _Built:
        return await asyncio.get_running_loop().run_in_executor(_BUILDER, build)

    def _render_pool(self, result: PoolResult) -> pb.PoolResponse | Awaitable[bytes]:
        """The protobuf answer, refused if too large to send: run by the runner inside the
        recorded call, so metrics count the refusal. A large one (token vectors) is built
        and serialized on a worker thread, in turn, as wire bytes the handlers pass through:
        tens of ms each, which the event loop would otherwise spend while other calls wait."""
        budget = self.runner.limits.response
        if values_in(result) <= OFF_LOOP_VALUES:
            return _sendable(convert.response_to_proto(result), budget)
        return self._in_turn(lambda: _wire_bytes(result, budget))

    def _render_streamed(self, result: PoolResult) -> pb.PoolResponse | Awaitable[pb.PoolResponse]:
        """A stream's answer, a message inside its PoolStreamResponse: a large one is built
        on a worker thread, in turn, for the same reasons as a unary one."""
        budget = self.runner.limits.response

        def build() -> pb.PoolResponse:
            return _sendable(convert.response_to_proto(result), budget)

        return build() if values_in(result) <= OFF_LOOP_VALUES else self._in_turn(build)

    async def Pool(
        self, request: pb.PoolRequest | Malformed, context: grpc.aio.ServicerContext
    ) -> pb.PoolResponse:
        try:
            if type(request) is Malformed:
                raise request.error()
            pool = convert.request_from_proto(request)  # type: ignore[arg-type]
            call = _call("Pool", context, _deadline(context))
            ran = await self.runner.pool(pool, call, self._render_pool)
        except PoolingError as error:
            await context.abort_with_status(to_grpc_status(error))
            raise  # unreachable: abort raises
        context.set_trailing_metadata(ran.record.trailing_metadata(ran.prompt_tokens))
        return ran.result

    async def Rerank(
        self, request: pb.RerankRequest | Malformed, context: grpc.aio.ServicerContext
    ) -> pb.RerankResponse:
        try:
            if type(request) is Malformed:
                raise request.error()
            rerank = convert.rerank_request_from_proto(request)  # type: ignore[arg-type]
            call = _call("Rerank", context, _deadline(context))
            ran = await self.runner.rerank(
                rerank,
                call,
                lambda result: convert.rerank_response_to_proto(result, request),  # type: ignore[arg-type]
            )
        except PoolingError as error:
            await context.abort_with_status(to_grpc_status(error))
            raise
        context.set_trailing_metadata(ran.record.trailing_metadata(ran.result.usage.prompt_tokens))
        return ran.result

    async def PoolStream(
        self,
        request_iterator: AsyncIterator[pb.PoolStreamRequest | Malformed],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.PoolStreamResponse]:
        """Requests run concurrently; each response is sent as soon as it is ready (see
        _Stream). One call, one client: the connection's peer (`_call`)."""
        call = _call("PoolStream", context, _deadline(context))
        stream = _Stream(self.runner, call, self._render_streamed, self.max_stream_inflight)
        async for response in stream.answer(request_iterator):
            yield response

    async def ListModels(
        self, request: pb.ListModelsRequest | Malformed, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        try:
            if type(request) is Malformed:
                raise request.error()
            call = _call("ListModels", context, _deadline(context))
            return (await self.runner.models(call, self._render_models)).result
        except PoolingError as error:
            await context.abort_with_status(to_grpc_status(error))
            raise

    def _render_models(self, engine: Engine) -> pb.ListModelsResponse:
        response = pb.ListModelsResponse(
            models=[convert.model_card(info) for info in engine.model_infos],
            max_client_batch_size=engine.limits.max_client_batch_size,
            max_stream_inflight=self.max_stream_inflight,
            server_version=server_version(),
        )
        add_adapters(response, engine.adapters)  # service/grpc/repository.py
        add_states(response, self.runner.repository)
        return response

    async def Tokenize(
        self, request: pb.TokenizeRequest | Malformed, context: grpc.aio.ServicerContext
    ) -> bytes:
        """The answer as wire bytes, laid out from the token arrays (convert.tokenize_response):
        the registered serializer passes bytes through (service/grpc/handlers.py)."""
        try:
            if type(request) is Malformed:
                raise request.error()
            add_special = (
                request.add_special_tokens if request.HasField("add_special_tokens") else True
            )
            call = _call("Tokenize", context, _deadline(context))
            budget = self.runner.limits.response
            ran = await self.runner.tokenize(
                request.model,
                request.texts,
                call,
                lambda tokenized: convert.tokenize_response(tokenized, budget),
                add_special,
                budget,
            )
            return ran.result
        except PoolingError as error:
            await context.abort_with_status(to_grpc_status(error))
            raise


_Answer = tuple[pb.PoolStreamResponse, int] | None  # a response and its weight; None: the end


class _Stream:
    """One PoolStream call, in named steps: `read` takes each message (`take`), which is
    refused in band or run (`compute`) concurrently; `answer` sends the responses as they
    come. The reader stops pulling while `max_inflight` items are unanswered, so a fast
    client cannot make the server buffer without bound. Every response counts, in-band
    errors too: one per message, an input request's weight."""

    def __init__(
        self,
        runner: RequestRunner,
        call: Call,
        render: Callable[[PoolResult], pb.PoolResponse | Awaitable[pb.PoolResponse]],
        max_inflight: int,
    ) -> None:
        self.runner, self.call, self.render = runner, call, render
        self.limit = InflightLimit(max_inflight)
        self.done: asyncio.Queue[_Answer] = asyncio.Queue()
        self.seen: set[str] = set()  # request ids used so far
        self.running: set[asyncio.Task[None]] = set()

    async def answer(
        self, messages: AsyncIterator[pb.PoolStreamRequest | Malformed]
    ) -> AsyncIterator[pb.PoolStreamResponse]:
        reader = asyncio.create_task(self.read(messages))
        try:
            while (item := await self.next(reader)) is not None:
                response, weight = item
                yield response
                self.limit.release(weight)
        finally:
            reader.cancel()
            for task in list(self.running):
                task.cancel()

    async def next(self, reader: asyncio.Task[None]) -> _Answer:
        """The next response ready; a failed read raised here."""
        while not reader.done():
            getter = asyncio.ensure_future(self.done.get())
            await asyncio.wait({getter, reader}, return_when=asyncio.FIRST_COMPLETED)
            if getter.done():
                return getter.result()
            getter.cancel()
        reader.result()  # re-raise a failed read; otherwise drain what is left
        return await self.done.get()

    async def read(self, messages: AsyncIterator[pb.PoolStreamRequest | Malformed]) -> None:
        """Errors about a message itself are answered in band, and the stream goes on."""
        index = -1
        async for message in messages:
            index += 1
            await self.take(index, message)
        await asyncio.gather(*self.running)
        await self.done.put(None)

    async def take(self, index: int, message: pb.PoolStreamRequest | Malformed) -> None:
        if type(message) is Malformed:
            # An in-band error is a response like any other: it takes a slot, so a client
            # that writes garbage and never reads is held back all the same.
            await self.limit.acquire(1)
            # One refused on the wire for its size answers to its id, if usable.
            request_id = message.request_id
            if stream_request_id_error(request_id, self.seen, index) is None:
                self.seen.add(request_id)
            else:
                request_id = ""
            self.refuse(request_id, message.error(f"messages[{index}]"), 1)
            return
        request_id = message.request.request_id
        try:
            request: PoolRequest | PoolingError = convert.request_from_proto(message.request)
        except PoolingError as error:
            request = error
        weight = 1 if isinstance(request, PoolingError) else _weight(request)
        await self.limit.acquire(weight)
        id_error = stream_request_id_error(request_id, self.seen, index)
        if id_error is not None:
            # Answered with an empty request_id (see PoolStreamResponse), so the client
            # never takes it for the answer to the request that first used it.
            self.refuse("", id_error, weight)
            return
        self.seen.add(request_id)
        if isinstance(request, PoolingError):
            self.refuse(request_id, request, weight)
            return
        task = asyncio.create_task(self.compute(request, weight))
        self.running.add(task)
        task.add_done_callback(self.running.discard)

    async def compute(self, request: PoolRequest, weight: int) -> None:
        try:
            ran = await self.runner.pool(request, self.call, self.render)
            response = pb.PoolStreamResponse(request_id=request.request_id, response=ran.result)
        except PoolingError as error:
            response = pb.PoolStreamResponse(
                request_id=request.request_id, error=to_status_proto(error)
            )
        await self.done.put((response, weight))

    def refuse(self, request_id: str, error: PoolingError, weight: int) -> None:
        response = pb.PoolStreamResponse(request_id=request_id, error=to_status_proto(error))
        self.done.put_nowait((response, weight))


def _sendable(response: _Message, budget: ResponseBudget) -> _Message:
    """`response`, measured: where the estimate let an answer through (sparse weights, say),
    a clear refusal rather than gRPC's own failure at send."""
    size = response.ByteSize()
    if size > budget.max_bytes:
        raise output_too_large("", size, budget)
    return response


def _wire_bytes(result: PoolResult, budget: ResponseBudget) -> bytes:
    data = convert.response_to_proto(result).SerializeToString()
    if len(data) > budget.max_bytes:
        raise output_too_large("", len(data), budget)
    return data


def _weight(request: PoolRequest) -> int:
    """The slots a stream request takes: its inputs (a score request's longer side)."""
    return max(len(request.texts), len(request.text_1), len(request.text_2), 1)
