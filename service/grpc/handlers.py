"""How PoolingService is registered: parsing that never raises, and one message per unary call.

grpcio answers a message that fails to deserialize with INTERNAL ("Exception
deserializing request"), which tells a client nothing and looks like a server bug.
Here each method's deserializer turns bad bytes into a `Malformed` marker instead, and
the servicer answers it with INVALID_ARGUMENT and reason MALFORMED_REQUEST. A large
message has its input lists counted on its bytes first (service/grpc/wire_count.py): one over
--max-client-batch-size is refused as TOO_MANY_INPUTS before protobuf builds it.

grpcio's asyncio server never answers a unary call that ends without a message (it takes
that for a cancellation), and serves one that carries two. So methods with one request
message are registered as client-streaming and read it themselves: none, or more than
one, is INVALID_ARGUMENT. The wire format is the same, so clients see a unary method.

Request messages are read through a gate (service/grpc/read_gate.py) that lets them in one at a
time while large ones come, and a connection's first message always. The handlers are
built once at startup; a call pays nothing beyond its own parse.

On grpcio's door two bounds are kept here, since gRPC core has neither: a unary call's
request must arrive whole within `arrival_s` (streams opened and never sent on, or sent a
byte a second, otherwise hold a handler and the open-call cap's slots for ever), and an
answer is counted against an AnswerBudget until gRPC core has sent it (a client that never
opens its receive window otherwise makes core hold every answer it asks for). The Node door
keeps both in node_door.mjs and passes neither.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import Message

from pooling_server.engine.errors import ErrorKind, FieldViolation, PoolingError
from pooling_server.engine.requests.shape_rules import too_many_inputs
from pooling_server.service.errors import to_grpc_status
from pooling_server.service.grpc.read_gate import ReadGate
from pooling_server.service.grpc.stream_limit import AnswerBudget
from pooling_server.service.grpc.wire_count import PRECOUNT_BYTES, SPECS, list_over_limit, string_at
from pooling_server.service.proto import pooling_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["PoolingService"]


@dataclass(frozen=True, slots=True)
class Malformed:
    """A message refused before protobuf built it: bytes that do not parse
    (MALFORMED_REQUEST), or an input list counted on the wire past the limit
    (TOO_MANY_INPUTS, `path` naming it). It holds no exception, only what makes one."""

    problem: str
    reason: str = "MALFORMED_REQUEST"
    path: str = ""
    request_id: str = ""  # a stream message's, when it could be read: its answer carries it

    def error(self, field: str | None = None) -> PoolingError:
        """`field`: which message it was, where a call carries several (a stream)."""
        if self.reason != "MALFORMED_REQUEST":
            path = f"{field}.{self.path}" if field else self.path
            violation = FieldViolation(path, self.problem, self.reason)
            return PoolingError.invalid([violation])
        message = f"the request message could not be parsed as protobuf: {self.problem}"
        violations = (FieldViolation(field, message, "MALFORMED_REQUEST"),) if field else ()
        return PoolingError(ErrorKind.INVALID_ARGUMENT, "MALFORMED_REQUEST", message, violations)


def tolerant(
    message_class: type[Message],
    input_limit: Callable[[], int | None] = lambda: None,
    saw: Callable[[int], None] = lambda size: None,
) -> Callable[[bytes], Message | Malformed]:
    """`input_limit`: the most entries an input list may hold (None: not known yet); a
    large message is counted on its bytes first (service/grpc/wire_count.py). `saw` is told
    each large message's size (the read gate's cue)."""
    parse = message_class.FromString
    spec = SPECS.get(message_class.__name__)
    stream = message_class.__name__ == "PoolStreamRequest"  # request (1) .request_id (1)

    def deserialize(data: bytes) -> Message | Malformed:
        limit = None
        if len(data) >= PRECOUNT_BYTES:
            saw(len(data))
            limit = None if spec is None else input_limit()
        if limit is not None:
            path = list_over_limit(data, spec, limit)  # type: ignore[arg-type]
            if path is not None:
                violation = too_many_inputs(path, None, limit)
                request_id = string_at(data, (1, 1)) if stream else ""
                return Malformed(violation.description, violation.reason, path, request_id)
        try:
            return parse(data)
        except Exception as exc:  # any parse failure is the client's
            return Malformed(str(exc) or type(exc).__name__)

    return deserialize


def _input_limit(servicer: Any) -> Callable[[], int | None]:
    """The engine's --max-client-batch-size, once the engine is there."""

    def limit() -> int | None:
        engine = getattr(servicer, "engine", None)
        if engine is None:
            engine = getattr(getattr(servicer, "runner", None), "engine", None)
        return None if engine is None else engine.limits.max_client_batch_size

    return limit


def add_pooling_service(
    servicer: Any,
    server: grpc.aio.Server,
    gate: ReadGate,
    answers: AnswerBudget | None = None,
    arrival_s: float | None = None,
) -> None:
    """Register every method of the service's descriptor on `servicer`'s same-named method,
    its request messages read through `gate`; `answers` and `arrival_s` (None: not here)
    as the module says."""
    handlers = {}
    limit = _input_limit(servicer)
    for method in SERVICE.methods:
        request_class = getattr(pb, method.input_type.name)
        response_class = getattr(pb, method.output_type.name)
        behaviour = getattr(servicer, method.name)
        if method.client_streaming:
            behaviour = _gated(behaviour, gate, answers)
        else:
            behaviour = _one_message(behaviour, gate, answers, arrival_s)
        kind = (
            grpc.stream_stream_rpc_method_handler
            if method.server_streaming
            else grpc.stream_unary_rpc_method_handler
        )
        handlers[method.name] = kind(
            behaviour,
            request_deserializer=tolerant(request_class, limit, gate.saw),
            response_serializer=_serializer(response_class),
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),)
    )
    server.add_registered_method_handlers(SERVICE.full_name, handlers)


Behaviour = Callable[[Any, grpc.aio.ServicerContext], Any]


def _serializer(message_class: type[Message]) -> Callable[[Message | bytes], bytes]:
    """A message serialized; an answer a method already laid out as wire bytes (Tokenize's,
    built from arrays rather than a message per token) passed through as it is."""
    serialize = message_class.SerializeToString

    def serialized(response: Message | bytes) -> bytes:
        return response if type(response) is bytes else serialize(response)  # type: ignore[arg-type,return-value]

    return serialized


def _gated(behaviour: Behaviour, gate: ReadGate, answers: AnswerBudget | None) -> Behaviour:
    """A streaming method's behaviour, fed the call's messages as the gate lets them in.
    Each response is counted in `answers` until the generator is resumed: grpcio resumes it
    once gRPC core has sent the response."""

    # An async generator function itself: grpcio takes any other callable for a sync one.
    async def call(requests: object, context: grpc.aio.ServicerContext) -> Any:
        peer = context.peer() if answers is not None else ""
        async for response in behaviour(gate.messages(context), context):
            if answers is None:
                yield response
                continue
            size = _size(response)
            refusal = answers.refusal(peer, size)
            if refusal is not None:
                del response  # as in _one_message
                await _unread(context, refusal)
            try:
                yield response
            finally:
                answers.give(peer, size)

    return call


def _one_message(
    behaviour: Behaviour,
    gate: ReadGate,
    answers: AnswerBudget | None,
    arrival_s: float | None,
) -> Behaviour:
    """A unary method's behaviour, fed the call's one request message, which must have come
    whole within `arrival_s`; its answer counted in `answers` until the call is over."""

    async def call(requests: object, context: grpc.aio.ServicerContext) -> Any:
        peer = gate.caller(context)
        try:
            async with asyncio.timeout(arrival_s):
                request = await gate.read(context, peer)
                if request is grpc.aio.EOF:
                    await _refuse(context, "the call ended without its request message")
                if await gate.read(context, peer) is not grpc.aio.EOF:
                    await _refuse(context, "the call carried more than one request message")
        except TimeoutError:
            error = PoolingError(
                ErrorKind.DEADLINE_EXCEEDED,
                "REQUEST_TIMEOUT",
                f"the request did not arrive within {arrival_s:g} s",
            )
            await context.abort_with_status(to_grpc_status(error))
        response = await behaviour(request, context)
        if answers is not None and response is not None:
            address = context.peer()
            size = _size(response)
            refusal = answers.refusal(address, size)
            if refusal is not None:
                # The abort's traceback keeps this frame as long as grpcio keeps the call
                # (as long as its client does): not the answer with it.
                del response
                await _unread(context, refusal)
            context.add_done_callback(lambda _: answers.give(address, size))
        return response

    return call


def _size(response: Message | bytes) -> int:
    return len(response) if type(response) is bytes else response.ByteSize()  # type: ignore[union-attr]


async def _unread(context: grpc.aio.ServicerContext, refusal: str) -> None:
    error = PoolingError(
        ErrorKind.RESOURCE_EXHAUSTED,
        "ANSWERS_UNREAD",
        f"{refusal}; the answer is dropped: read your answers, or retry later",
        retry_after_s=1.0,
    )
    await context.abort_with_status(to_grpc_status(error))


async def _refuse(context: grpc.aio.ServicerContext, problem: str) -> None:
    error = PoolingError(ErrorKind.INVALID_ARGUMENT, "ONE_MESSAGE_EXPECTED", problem)
    await context.abort_with_status(to_grpc_status(error))
