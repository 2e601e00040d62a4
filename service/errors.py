"""The errors table, and the one place errors become protocol statuses: each error kind,
and each reason a door answers differently, mapped to its gRPC code, its HTTP status and
the envelope of each HTTP family. Every door renders errors from here (gRPC codes with
google.rpc details, HTTP envelopes) and writes no status of its own.

HTTP families:
- OPENAI: the OpenAI/vLLM routes and batch lines, `{"error": {message, type, param, code,
  reason, field_violations}}` (OpenAI's envelope plus the gRPC details); also what a
  request that matches no route gets.
- TEI: text-embeddings-inference's `{"error", "error_type"}`, its statuses (400 Empty,
  413 for size, 422 Validation or Tokenizer, 424 Backend, 429 Overloaded, 503 Unhealthy).
- COHERE: Cohere v2's `{"id", "message", "reason"}`; a bad request is always 400.

A door names fields in its own terms: the engine's violations carry the gRPC request's
paths (`embed.texts[2]`), which a door's FieldMap translates (`inputs[2]`), path by path.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import Message
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from pooling_server.engine.errors import MESSAGE_VIOLATIONS, ErrorKind, FieldViolation, PoolingError


class Family(StrEnum):
    OPENAI = "openai"
    TEI = "tei"
    COHERE = "cohere"


@dataclass(frozen=True)
class Row:
    """How one kind (or one reason of it) renders: `http` is the OpenAI/vLLM status,
    `tei` TEI's (status, error_type), `cohere` Cohere's status."""

    grpc: grpc.StatusCode
    http: int
    tei: tuple[int, str]
    cohere: int

    def status(self, family: Family) -> int:
        if family is Family.TEI:
            return self.tei[0]
        return self.cohere if family is Family.COHERE else self.http


_G = grpc.StatusCode
_INVALID = Row(_G.INVALID_ARGUMENT, 400, (422, "Validation"), 400)
_SIZE = replace(_INVALID, tei=(413, "Validation"))  # TEI answers size limits 413

# (kind, reason) -> Row; reason "" is the kind's row, for every reason not listed.
TABLE: dict[tuple[ErrorKind, str], Row] = {
    (ErrorKind.INVALID_ARGUMENT, ""): _INVALID,
    # JSON of the wrong shape: OpenAI's (and FastAPI's, vLLM's) 422.
    (ErrorKind.INVALID_ARGUMENT, "INVALID_BODY"): replace(_INVALID, http=422),
    (ErrorKind.INVALID_ARGUMENT, "EMPTY_INPUT"): replace(_INVALID, tei=(400, "Empty")),
    (ErrorKind.INVALID_ARGUMENT, "TOO_MANY_INPUTS"): _SIZE,
    (ErrorKind.INVALID_ARGUMENT, "REQUEST_TOO_LARGE"): _SIZE,
    (ErrorKind.INVALID_ARGUMENT, "OUTPUT_TOO_LARGE"): _SIZE,
    (ErrorKind.INVALID_ARGUMENT, "INPUT_TOO_LONG"): replace(_INVALID, tei=(422, "Tokenizer")),
    (ErrorKind.INVALID_ARGUMENT, "TOKEN_ID_INVALID"): replace(_INVALID, tei=(422, "Tokenizer")),
    # Images: bytes or pixels over the limits, or too many in a request, are sizes (TEI's
    # 413); IMAGE_INVALID, IMAGE_FORMAT_UNSUPPORTED and IMAGE_URL_NOT_ALLOWED take the
    # kind's row.
    (ErrorKind.INVALID_ARGUMENT, "IMAGE_TOO_LARGE"): _SIZE,
    (ErrorKind.INVALID_ARGUMENT, "TOO_MANY_IMAGES"): _SIZE,
    # Audio clips as images: bytes, duration or clips over the limits are sizes;
    # AUDIO_INVALID, AUDIO_FORMAT_UNSUPPORTED, AUDIO_SAMPLE_RATE_UNSUPPORTED,
    # AUDIO_TOO_MANY_CHANNELS and AUDIO_URL_NOT_ALLOWED take the kind's row.
    (ErrorKind.INVALID_ARGUMENT, "AUDIO_TOO_LARGE"): _SIZE,
    (ErrorKind.INVALID_ARGUMENT, "AUDIO_TOO_LONG"): _SIZE,
    (ErrorKind.INVALID_ARGUMENT, "TOO_MANY_AUDIO_CLIPS"): _SIZE,
    # HTTP's own refusals, before a route reads the request.
    (ErrorKind.INVALID_ARGUMENT, "METHOD_NOT_ALLOWED"): Row(
        _G.UNIMPLEMENTED, 405, (405, "Validation"), 405
    ),
    (ErrorKind.INVALID_ARGUMENT, "EXPECTATION_FAILED"): Row(
        _G.INVALID_ARGUMENT, 417, (417, "Validation"), 417
    ),
    # The gRPC door's refusals of a message's compression, before a handler sees it: gRPC's
    # compression spec names INTERNAL for a Compressed-Flag without a grpc-encoding, and
    # UNIMPLEMENTED for an encoding the server does not take (HTTP's 415).
    (ErrorKind.INVALID_ARGUMENT, "COMPRESSED_WITHOUT_ENCODING"): Row(
        _G.INTERNAL, 400, (422, "Validation"), 400
    ),
    (ErrorKind.INVALID_ARGUMENT, "ENCODING_UNSUPPORTED"): Row(
        _G.UNIMPLEMENTED, 415, (415, "Validation"), 415
    ),
    (ErrorKind.NOT_FOUND, ""): Row(_G.NOT_FOUND, 404, (422, "Validation"), 404),
    (ErrorKind.NOT_FOUND, "NOT_FOUND"): Row(_G.UNIMPLEMENTED, 404, (404, "Validation"), 404),
    (ErrorKind.FAILED_PRECONDITION, ""): Row(_G.FAILED_PRECONDITION, 412, (424, "Backend"), 400),
    # A model that would not load (at run time, service/repository.py): HTTP's Failed
    # Dependency, remembered for --failed-load-ttl-s, its Retry-After.
    (ErrorKind.FAILED_PRECONDITION, "MODEL_LOAD_FAILED"): Row(
        _G.FAILED_PRECONDITION, 424, (424, "Backend"), 424
    ),
    # A LoRA adapter that would not load (service/adapters.py): as a model's.
    (ErrorKind.FAILED_PRECONDITION, "ADAPTER_LOAD_FAILED"): Row(
        _G.FAILED_PRECONDITION, 424, (424, "Backend"), 424
    ),
    (ErrorKind.RESOURCE_EXHAUSTED, ""): Row(_G.RESOURCE_EXHAUSTED, 429, (429, "Overloaded"), 429),
    (ErrorKind.RESOURCE_EXHAUSTED, "REQUEST_ENTITY_TOO_LARGE"): Row(
        _G.RESOURCE_EXHAUSTED, 413, (413, "Validation"), 413
    ),
    (ErrorKind.DEADLINE_EXCEEDED, ""): Row(_G.DEADLINE_EXCEEDED, 504, (504, "Backend"), 504),
    # A body that arrives too slowly: HTTP's Request Timeout.
    (ErrorKind.DEADLINE_EXCEEDED, "BODY_TIMEOUT"): Row(
        _G.DEADLINE_EXCEEDED, 408, (408, "Validation"), 408
    ),
    (ErrorKind.CANCELLED, ""): Row(_G.CANCELLED, 499, (499, "Backend"), 499),
    (ErrorKind.UNAVAILABLE, ""): Row(_G.UNAVAILABLE, 503, (503, "Unhealthy"), 503),
    (ErrorKind.UNAUTHENTICATED, ""): Row(_G.UNAUTHENTICATED, 401, (401, "Validation"), 401),
    # TEI's Backend for anything the model failed at.
    (ErrorKind.INTERNAL, ""): Row(_G.INTERNAL, 500, (424, "Backend"), 500),
    # A gRPC handler that raised: grpc.aio answers UNKNOWN, and the Node door does as it does.
    (ErrorKind.INTERNAL, "HANDLER_FAILED"): Row(_G.UNKNOWN, 500, (424, "Backend"), 500),
}
# The reasons HTTP statuses stand for, as aiohttp raises them (web.HTTPException).
HTTP_REASONS: dict[int, tuple[ErrorKind, str]] = {
    404: (ErrorKind.NOT_FOUND, "NOT_FOUND"),
    405: (ErrorKind.INVALID_ARGUMENT, "METHOD_NOT_ALLOWED"),
    413: (ErrorKind.RESOURCE_EXHAUSTED, "REQUEST_ENTITY_TOO_LARGE"),
    417: (ErrorKind.INVALID_ARGUMENT, "EXPECTATION_FAILED"),
}
# OpenAI's error `type` values, which its SDK and the tools built on it read; any other
# 4xx is invalid_request_error, a 5xx server_error.
OPENAI_TYPES = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}
RETRY_STATUSES = (429, 503)  # the statuses that carry Retry-After


def row(error: PoolingError) -> Row:
    return TABLE.get((error.kind, error.reason)) or TABLE[(error.kind, "")]


def http_status(error: PoolingError, family: Family = Family.OPENAI) -> int:
    return row(error).status(family)


def grpc_code(error: PoolingError) -> grpc.StatusCode:
    return row(error).grpc


def grpc_code_of(kind: ErrorKind, reason: str = "") -> grpc.StatusCode:
    """The gRPC code of a reason a door answers with no PoolingError behind it."""
    return (TABLE.get((kind, reason)) or TABLE[(kind, "")]).grpc


def from_http(status: int, phrase: str, message: str) -> PoolingError:
    """An HTTP refusal aiohttp raised (no route, a wrong method, a body over the limit);
    `phrase`: its reason phrase ("Not Found"), the reason of a status not in HTTP_REASONS."""
    fallback = ErrorKind.INTERNAL if status >= 500 else ErrorKind.INVALID_ARGUMENT
    kind, reason = HTTP_REASONS.get(status, (fallback, phrase.upper().replace(" ", "_")))
    return PoolingError(kind, reason, message)


# ------------------------------------------------------------------ field names


@dataclass(frozen=True)
class FieldMap:
    """A door's names for the engine's request paths (`fields`, matched on a path's head,
    before its first `[`), and its own advice for a reason whose engine description ends
    in the engine's advice (after its last "; "), for the door's fields."""

    fields: Mapping[str, str] = field(default_factory=dict)
    advice: Mapping[str, str] = field(default_factory=dict)

    def violation(self, v: FieldViolation) -> FieldViolation:
        head, bracket, rest = v.field.partition("[")
        name = self.fields.get(head)
        if name is None:
            return v
        description = v.description
        if v.reason in self.advice:
            fact, sep, _ = description.rpartition("; ")
            description = f"{fact}{sep}{self.advice[v.reason]}" if sep else description
        return FieldViolation(f"{name}{bracket}{rest}", description, v.reason)

    def error(self, error: PoolingError) -> PoolingError:
        """`error` in the door's names; a message not built from its violations is kept."""
        if not self.fields or not error.violations:
            return error
        if error.message != _message(error.violations):
            return error
        violations = tuple(self.violation(v) for v in error.violations)
        if all(new is old for new, old in zip(violations, error.violations, strict=True)):
            return error  # nothing of the engine's to rename
        return PoolingError(
            error.kind,
            error.reason,
            _message(violations),
            violations,
            error.metadata,
            error.retry_after_s,
        )


def _message(violations: Sequence[FieldViolation]) -> str:
    """PoolingError.invalid's message for these violations."""
    shown = violations[:MESSAGE_VIOLATIONS]
    message = "; ".join(f"{v.field}: {v.description}" for v in shown)
    if len(violations) > len(shown):
        message += f" (and {len(violations) - len(shown)} more)"
    return message


# ------------------------------------------------------------------ HTTP envelopes


@dataclass(frozen=True)
class HttpError:
    """What an HTTP door sends for an error: status, JSON body, and headers."""

    status: int
    body: dict[str, Any]
    headers: dict[str, str]


def http_error(
    error: PoolingError,
    family: Family = Family.OPENAI,
    names: FieldMap | None = None,
    request_id: str = "",
) -> HttpError:
    """`error` in `family`'s envelope, its fields in `names`; `request_id`: Cohere's id."""
    if names is not None:
        error = names.error(error)
    status = http_status(error, family)
    if family is Family.TEI:
        body = {"error": error.message, "error_type": row(error).tei[1]}
    elif family is Family.COHERE:
        body = cohere_body(status, error, request_id)
    else:
        body = openai_body(status, error)
    headers = {}
    if error.retry_after_s is not None and status in RETRY_STATUSES:
        headers["Retry-After"] = str(max(1, round(error.retry_after_s)))
    return HttpError(status, body, headers)


def openai_body(status: int, error: PoolingError) -> dict[str, Any]:
    """OpenAI's error envelope (message, type, param, code), plus the gRPC details:
    the reason, every field violation, the metadata and the retry delay."""
    violations = error.violations
    detail: dict[str, Any] = {
        "message": error.message,
        "type": OPENAI_TYPES.get(
            status, "server_error" if status >= 500 else "invalid_request_error"
        ),
        "param": violations[0].field if violations else None,
        "code": error.reason,
        "reason": error.reason,
        "field_violations": [
            {"field": v.field, "description": v.description, "reason": v.reason} for v in violations
        ],
    }
    if error.metadata:
        detail["metadata"] = error.metadata
    if error.retry_after_s is not None:
        detail["retry_after_s"] = error.retry_after_s
    return {"error": detail}


def cohere_body(status: int, error: PoolingError, request_id: str) -> dict[str, Any]:
    """Cohere's {"id", "message"}; a 400's message begins "invalid request: " as Cohere's do."""
    message = f"invalid request: {error.message}" if status == 400 else error.message
    body: dict[str, Any] = {"id": request_id, "message": message}
    if error.reason:
        body["reason"] = error.reason
    return body


# ------------------------------------------------------------------ gRPC

DOMAIN = "pooling.v1"
# A unary status travels in trailers, which clients cap (8 KiB by default): the details
# carry this many field violations at most, and ErrorInfo says how many there were.
MAX_FIELD_VIOLATIONS = 16


def status_label(protocol: str, kind: ErrorKind | None) -> str:
    """The status a metric or log line carries: the protocol's own (a gRPC code name, or
    the OpenAI/vLLM HTTP status for the HTTP doors and batch jobs); None is success. A
    door whose status depends on the reason gives the runner its own (service/http/door.py)."""
    if protocol == "grpc":
        return "OK" if kind is None else TABLE[(kind, "")].grpc.name
    return "200" if kind is None else str(TABLE[(kind, "")].http)


def unavailable(message: str) -> PoolingError:
    return PoolingError(ErrorKind.UNAVAILABLE, "NOT_READY", message, retry_after_s=1.0)


def _pack(message: Message) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def to_status_proto(error: PoolingError) -> status_pb2.Status:
    code: grpc.StatusCode = grpc_code(error)
    metadata = dict(error.metadata)
    if len(error.violations) > MAX_FIELD_VIOLATIONS:
        metadata["field_violations"] = str(len(error.violations))
    details = [
        _pack(error_details_pb2.ErrorInfo(reason=error.reason, domain=DOMAIN, metadata=metadata))
    ]
    if error.violations:
        bad_request = error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(
                    field=v.field, description=v.description, reason=v.reason
                )
                for v in error.violations[:MAX_FIELD_VIOLATIONS]
            ]
        )
        details.append(_pack(bad_request))
    if error.retry_after_s is not None:
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(int(error.retry_after_s * 1e9))
        details.append(_pack(error_details_pb2.RetryInfo(retry_delay=delay)))
    return status_pb2.Status(
        code=getattr(code_pb2, code.name), message=error.message, details=details
    )


def to_grpc_status(error: PoolingError) -> grpc.Status:
    return rpc_status.to_status(to_status_proto(error))
