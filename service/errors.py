"""The one place engine errors become protocol statuses: gRPC codes with google.rpc details,
and HTTP statuses. Each door renders its own envelope from these."""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import Message
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from engine.errors import ErrorKind, PoolingError

DOMAIN = "pooling.v1"
# A unary status travels in trailers, which clients cap (8 KiB by default): the details
# carry this many field violations at most, and ErrorInfo says how many there were.
MAX_FIELD_VIOLATIONS = 16

# Each error kind's gRPC code and HTTP status, side by side.
STATUSES: dict[ErrorKind, tuple[grpc.StatusCode, int]] = {
    ErrorKind.INVALID_ARGUMENT: (grpc.StatusCode.INVALID_ARGUMENT, 400),
    ErrorKind.NOT_FOUND: (grpc.StatusCode.NOT_FOUND, 404),
    ErrorKind.FAILED_PRECONDITION: (grpc.StatusCode.FAILED_PRECONDITION, 412),
    ErrorKind.RESOURCE_EXHAUSTED: (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
    ErrorKind.DEADLINE_EXCEEDED: (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
    ErrorKind.CANCELLED: (grpc.StatusCode.CANCELLED, 499),
    ErrorKind.UNAVAILABLE: (grpc.StatusCode.UNAVAILABLE, 503),
    ErrorKind.INTERNAL: (grpc.StatusCode.INTERNAL, 500),
}
GRPC_CODES: dict[ErrorKind, grpc.StatusCode] = {k: v[0] for k, v in STATUSES.items()}
HTTP_STATUS: dict[ErrorKind, int] = {k: v[1] for k, v in STATUSES.items()}


def status_label(protocol: str, kind: ErrorKind | None) -> str:
    """The status a metric or log line carries: the protocol's own (a gRPC code name, or
    an HTTP status for the HTTP doors and batch jobs); None is success."""
    if protocol == "grpc":
        return "OK" if kind is None else GRPC_CODES[kind].name
    return "200" if kind is None else str(HTTP_STATUS[kind])


def unavailable(message: str) -> PoolingError:
    return PoolingError(ErrorKind.UNAVAILABLE, "NOT_READY", message, retry_after_s=1.0)


def _pack(message: Message) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def to_status_proto(error: PoolingError) -> status_pb2.Status:
    code = GRPC_CODES[error.kind]
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
