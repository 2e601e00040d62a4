"""What the HTTP doors share (OpenAI/vLLM's in service/http/app.py, TEI's, Cohere's):
reading their bodies' common fields, the runner's view of a call, and rendering engine
arrays as JSON (`render`: encoded off the loop when large, refused over the cap).

The doors answer straight from the engine's numpy arrays (no protobuf on the way): a
whole batch of vectors becomes nested lists in one `tolist()`, and msgspec encodes them.
Large answers are built and encoded on a worker thread, so the event loop keeps serving
other connections, and an answer over --max-http-response-mb is refused.
"""

from __future__ import annotations

import asyncio
import base64
import re
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import msgspec
import numpy as np
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from engine.errors import ErrorKind, FieldViolation, PoolingError
from engine.model_info import ModelInfo
from engine.output_size import ResponseBudget
from engine.validation import output_too_large
from service.http import json_body
from service.http.guard import body_parsed, body_read, client_problem
from service.runner import Call, RequestRunner

# Answers of more float values than this are built and encoded off the event loop.
OFF_LOOP_VALUES = 100_000
OFF_LOOP_BODY = 1024 * 1024  # bodies larger than this are checked and decoded off the loop
T = TypeVar("T")
JSON_FLOAT_BYTES = 21  # a float32 as the shortest double that reads back, with its comma

_encoder = msgspec.json.Encoder()


class DoorHost(Protocol):
    """What a route family (service/http/tei.py, http_cohere.py) takes from the app that
    hangs it (service/http/app.py's HttpApi): the runner, and the response cap
    (--max-http-response-mb), read at each request. The families name this rather than
    HttpApi, so that the app imports them and not the other way round."""

    runner: RequestRunner
    max_response_bytes: int


class DoorError(Exception):
    """A body a door refuses before the engine sees it, in the door's own terms: the HTTP
    status, the door's error type, and the message (naming the field at fault)."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.message = message


def call(
    request: web.Request, rpc: str, statuses: Callable[[PoolingError], int] | None = None
) -> Call:
    """The runner's view of an HTTP call: its headers (for the caller's trace context), its
    peer address (the queue's fairness between clients), and the door's status for an
    error where it is not the generic HTTP one (TEI's 422), for the metrics."""
    headers = [(key.lower(), value) for key, value in request.headers.items()]
    return Call(
        protocol="http",
        rpc=rpc,
        headers=headers,
        client=request.remote or "unknown",
        statuses=statuses,
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
    return runner.ready().resolve(name).info


def budget(
    max_bytes: int, float_bytes: int = JSON_FLOAT_BYTES, item_bytes: int = 16
) -> ResponseBudget:
    """The engine's bound on an answer an HTTP door sends as JSON (values only);
    `item_bytes`: each item's envelope around its values."""
    return ResponseBudget(
        max_bytes=max_bytes,
        setting="--max-http-response-mb",
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


async def read_body(request: web.Request, max_inputs: int) -> json_body.Body:
    """The body as service/http/json_body.py reads it (the OpenAI/vLLM routes'), its input lists
    counted against `max_inputs` as read."""
    return await _parsed(request, lambda raw: json_body.parse_body(raw, max_inputs))


async def decode_body(request: web.Request, kind: type[Any]) -> Any:
    """The body as `kind`, its nesting checked first (service/http/json_body.py's bound); a
    wrong type stops at the first wrong value."""
    return await _parsed(request, lambda raw: _decode(raw, kind))


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


def _decode(raw: bytes | bytearray, kind: type[Any]) -> Any:
    json_body._check_depth(raw)
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as exc:
        raise DoorError(422, "Validation", where(str(exc))) from None
    except msgspec.DecodeError as exc:
        raise DoorError(422, "Validation", f"the body is not valid JSON: {exc}") from None


def _at(problem: str) -> tuple[str, str]:
    """msgspec's "Expected `bool`, got `str` - at `$.normalize`" as (message, ".normalize")."""
    message, _, at = problem.partition(" - at `$")
    return message, at.rstrip("`")


def where(problem: str) -> str:
    """A body's decode error as "normalize: Expected `bool`, got `str`"."""
    message, at = _at(problem)
    return f"{at.lstrip('.') or 'body'}: {message}"


def within(field: str, exc: msgspec.DecodeError) -> str:
    """A raw field's decode error, its path inside the field kept: "inputs[0][1]: Expected
    `str`, got `int`", or "inputs: Invalid UTF-8 encoded string"."""
    message, at = _at(str(exc))
    return f"{field}{at}: {message}"


def text_list(raw: msgspec.Raw, field: str, max_inputs: int) -> list[str]:
    """A string or a list of strings, counted on the bytes before it is built."""
    if not present(raw):
        raise DoorError(422, "Validation", f"{field}: missing; send a string or a list of strings")
    value = json_body._decode_list(field, raw, max_inputs)
    if isinstance(value, tuple):
        _, violation = value
        status = 413 if violation.reason == "TOO_MANY_INPUTS" else 422
        raise DoorError(status, "Validation", f"{violation.field}: {violation.description}")
    return value


def matrix(rows: Sequence[np.ndarray]) -> list[Any]:
    """Equal-length float vectors as nested lists, in one conversion when they stack."""
    if not rows:
        return []
    if all(row.shape == rows[0].shape for row in rows):
        return np.stack(rows).tolist()
    return [row.tolist() for row in rows]


def base64_floats(values: np.ndarray) -> str:
    """Values as the base64 of their little-endian float32 bytes (OpenAI's, vLLM's and
    Cohere's base64 encoding)."""
    return base64.b64encode(np.ascontiguousarray(values, dtype="<f4").tobytes()).decode("ascii")


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


def rename_fields(message: str, names: dict[str, str]) -> str:
    """The engine names fields by the gRPC request's paths (`embed.texts[2]`); a door's
    errors name its own (`inputs[2]`). A name is matched whole, never inside a longer one
    (`embed.texts` within `token_embed.texts`)."""
    pattern = re.compile(
        r"(?<![\w.])(" + "|".join(map(re.escape, sorted(names, key=len, reverse=True))) + ")"
    )
    return pattern.sub(lambda found: names[found.group(1)], message)


def unprocessable(field: str, description: str) -> PoolingError:
    """An engine-style refusal for a field the door checks itself."""
    return PoolingError.invalid([FieldViolation(field, description, "INVALID_BODY")])


def is_kind(error: PoolingError, kind: ErrorKind, *reasons: str) -> bool:
    return error.kind is kind and (not reasons or error.reason in reasons)
