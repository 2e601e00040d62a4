"""What the HTTP doors share (OpenAI/vLLM's in service/http/app.py, TEI's, Cohere's):
reading their bodies' common fields, their refusals (PoolingErrors, rendered by the app's
middleware from service/errors.py in the route family's envelope), the runner's view
of a call, and rendering engine arrays as JSON (`render`: encoded off the loop when large,
refused over the cap).

The doors answer straight from the engine's numpy arrays (no protobuf on the way): a
whole batch of vectors becomes nested lists in one `tolist()`, and msgspec encodes them.
Large answers are built and encoded on a worker thread, so the event loop keeps serving
other connections, and an answer over --max-http-response-mb is refused.
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import msgspec
import numpy as np
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from pooling_server.engine.errors import ErrorKind, FieldViolation, PoolingError, internal_error
from pooling_server.engine.models.model_info import ModelInfo
from pooling_server.engine.requests.output_size import MIB, ResponseBudget
from pooling_server.engine.requests.outputs import OFF_LOOP_VALUES
from pooling_server.engine.requests.size_rules import output_too_large
from pooling_server.service.errors import Family, http_status
from pooling_server.service.http import json_body
from pooling_server.service.http.guard import body_parsed, body_read, client_problem
from pooling_server.service.runner import Call, RequestRunner

# Answers of more float values than this are built and encoded off the event loop.
OFF_LOOP_BODY = 1024 * 1024  # bodies larger than this are checked and decoded off the loop
T = TypeVar("T")
B = TypeVar("B", bound=msgspec.Struct)
# What one output value costs in an answer's JSON, for its budget (engine/requests/output_size.py):
# a float32 as the shortest double that reads back, with its comma; in base64, 5.33 bytes
# (4 bytes, 4/3 of them).
JSON_FLOAT_BYTES = 21
BASE64_FLOAT_BYTES = 6
# The largest answer (--max-http-response-mb), and a batch job's line.
MAX_RESPONSE_BYTES = 64 * MIB
# Where the app's middleware finds a request's route family (for its errors' envelope)
# and the errors the runner has counted (so that it counts the others, the door's own).
FAMILY = web.RequestKey("family", Family)
COUNTED = web.RequestKey("counted", list)
REQUEST_ID = web.RequestKey("request_id", str)  # a route's request id, where it has one

_encoder = msgspec.json.Encoder()


class DoorHost(Protocol):
    """What a route family (service/http/tei.py, http_cohere.py) takes from the app that
    hangs it (service/http/app.py's HttpApi): the runner, and the response cap
    (--max-http-response-mb), read at each request. The families name this rather than
    HttpApi, so that the app imports them and not the other way round."""

    runner: RequestRunner
    max_response_bytes: int


def refused(field: str, description: str, reason: str = "INVALID_BODY") -> PoolingError:
    """A door's refusal of one field, named as the door's clients send it."""
    return PoolingError.invalid([FieldViolation(field, description, reason)])


def empty(field: str) -> PoolingError:
    """An empty input list, in TEI's words (TEI's 400 Empty)."""
    violation = FieldViolation(field, "cannot be empty", "EMPTY_INPUT")
    message = f"`{field}` cannot be empty"
    return PoolingError(ErrorKind.INVALID_ARGUMENT, "EMPTY_INPUT", message, (violation,))


def too_many(count: int, max_inputs: int, field: str, named: bool = False) -> PoolingError:
    """More inputs than --max-client-batch-size, in TEI's words (`named`: and the field)."""
    violation = FieldViolation(field, f"holds {count} inputs, over {max_inputs}", "TOO_MANY_INPUTS")
    message = f"batch size {count} > maximum allowed batch size {max_inputs}"
    if named:
        message += f" ({field})"
    return PoolingError(ErrorKind.INVALID_ARGUMENT, "TOO_MANY_INPUTS", message, (violation,))


def call(request: web.Request, rpc: str) -> Call:
    """The runner's view of an HTTP call: its headers (for the caller's trace context), its
    peer address (the queue's fairness between clients), and the status the route's family
    answers an error with (TEI's 422 for a bad field), which the metrics record; each
    error the runner counts is noted, so that the middleware counts only the door's own."""
    headers = [(key.lower(), value) for key, value in request.headers.items()]
    family = request.get(FAMILY, Family.OPENAI)
    counted = request.setdefault(COUNTED, [])

    def status(error: PoolingError) -> int:
        counted.append(error)
        return http_status(error, family)

    return Call(
        protocol="http",
        rpc=rpc,
        headers=headers,
        client=request.remote or "unknown",
        statuses=status,
    )


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def request_id(request: web.Request, prefix: str) -> str:
    """The caller's X-Request-Id, or a new one. It is echoed and logged, so bytes that are
    not UTF-8 (aiohttp reads them as surrogates) are refused, on every door alike."""
    given = request.headers.get("X-Request-Id")
    if not given:
        return new_request_id(prefix)
    try:
        given.encode()
    except UnicodeEncodeError:
        violation = FieldViolation(
            "X-Request-Id", "must be UTF-8 text (it becomes the request_id)", "REQUEST_ID_INVALID"
        )
        raise PoolingError.invalid([violation]) from None
    return given


def served_model(runner: RequestRunner, name: str) -> ModelInfo:
    """The model a request names, or the default model (TEI's requests name none)."""
    return runner.ready().model_named(name).info


def budget(
    max_bytes: int,
    float_bytes: int = JSON_FLOAT_BYTES,
    item_bytes: int = 16,
    setting: str = "--max-http-response-mb",
) -> ResponseBudget:
    """The engine's bound on an answer sent as JSON (values only, no compact encodings),
    the one every HTTP door and batch line builds; `item_bytes`: each item's envelope
    around its values (TEI's `[...]`; OpenAI's {"index": ..., "object": ..., "data": [...]}
    about 64 bytes)."""
    return ResponseBudget(
        max_bytes=max_bytes,
        setting=setting,
        float_bytes=float_bytes,
        item_bytes=item_bytes,
        row_bytes=3,
        encodings=False,
    )


def present(raw: msgspec.Raw) -> bool:
    return len(raw) > 0 and bytes(raw) != b"null"


async def read_raw(request: web.Request) -> bytes | bytearray:
    """The body's bytes: those the guard read, or read now when the body came whole with
    its headers. One that cannot be read as its headers say (a Content-Encoding its bytes
    do not decode by, a chunked body cut short) is the client's MALFORMED_REQUEST, which
    every door answers in its own shape; a client gone mid-body is a cancelled call."""
    if (body := body_read(request)) is not None:
        return body
    try:
        return await request.read()
    except RequestPayloadError as exc:
        raise PoolingError(
            ErrorKind.INVALID_ARGUMENT,
            "MALFORMED_REQUEST",
            f"the body could not be read as its headers describe it: {client_problem(exc)}",
        ) from None
    except ConnectionError:
        raise asyncio.CancelledError from None


async def read_body(request: web.Request, kind: type[B], max_inputs: int) -> B:
    """The body as its route's declared type `kind`, decoded within its bounds
    (service/http/json_body.py), its input lists counted against `max_inputs`."""
    return await _parsed(request, lambda raw: json_body.decode(raw, kind, max_inputs))


async def _parsed(request: web.Request, parse: Callable[[bytes | bytearray], T]) -> T:
    """The body read and parsed, on a worker thread when large; then a large body's read
    turns pass on (service/http/guard.py), whether the parse succeeded or not."""
    raw = await read_raw(request)
    try:
        if len(raw) > OFF_LOOP_BODY:
            return await asyncio.to_thread(parse, raw)
        return parse(raw)
    finally:
        body_parsed(request)


def matrix(rows: Sequence[np.ndarray]) -> list[Any]:
    """Equal-length float vectors as nested lists, in one conversion when they stack."""
    if not rows:
        return []
    if all(row.shape == rows[0].shape for row in rows):
        return np.stack(rows).tolist()
    return [row.tolist() for row in rows]


def output_of(output: Any, kind: type | tuple[type, ...]) -> Any:
    """An engine output, checked to be of the kind the route asked for (INTERNAL if not)."""
    if not isinstance(output, kind):
        raise internal_error()
    return output


def binary_response(
    parts: Sequence[bytes], metadata: dict[str, Any] | None, max_bytes: int
) -> web.Response:
    """vLLM's bytes answer: the arrays' bytes as the body, their layout in a `metadata`
    header (none for bytes_only)."""
    size = sum(map(len, parts))
    if size > max_bytes:
        raise output_too_large("", size, budget(max_bytes))
    headers = {} if metadata is None else {"metadata": _encoder.encode(metadata).decode()}
    body = b"".join(parts)
    return web.Response(body=body, headers=headers, content_type="application/octet-stream")


def base64_floats(values: np.ndarray) -> str:
    """Values as the base64 of their little-endian float32 bytes (OpenAI's, vLLM's and
    Cohere's base64 encoding)."""
    return base64_of(np.ascontiguousarray(values, dtype="<f4").tobytes())


def base64_of(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


async def render(
    build: Callable[[], Any], values: int, max_bytes: int, status: int = 200
) -> web.Response:
    """A JSON body from `build()`; one of many values is built and encoded on a worker
    thread. One over `max_bytes` is refused (the engine's estimate let it through: this is
    the safety net, not the rule)."""
    if values > OFF_LOOP_VALUES:
        body = await asyncio.to_thread(lambda: _encoder.encode(build()))
    else:
        body = _encoder.encode(build())
    if len(body) > max_bytes:
        raise output_too_large("", len(body), budget(max_bytes))
    return web.Response(body=body, status=status, content_type="application/json")


def json_response(payload: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=_encoder.encode(payload), status=status, content_type="application/json"
    )
