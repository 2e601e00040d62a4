"""PoolingError: a failed call with the server's rich error details decoded.

The server attaches a ``google.rpc.Status`` to every failure, carrying an ``ErrorInfo`` (a
stable ``reason`` such as "DIMENSIONS_NOT_SUPPORTED"), for bad input a ``BadRequest`` naming
the offending fields, and for overload a ``RetryInfo``. Unary calls send it in the
``grpc-status-details-bin`` trailer; streams send it in-band. This module decodes both into one
exception type so callers can branch on ``reason`` instead of parsing messages. It decodes the
trailer itself to avoid depending on grpcio-status.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2

#: The trailing-metadata key that carries a serialized google.rpc.Status.
STATUS_DETAILS_KEY = "grpc-status-details-bin"

_CODES_BY_VALUE: dict[int, grpc.StatusCode] = {code.value[0]: code for code in grpc.StatusCode}


@dataclass(frozen=True)
class FieldViolation:
    """One bad field of a request, e.g. field="params.dimensions"."""

    field: str
    description: str
    reason: str = ""


class PoolingError(Exception):
    """A call that failed on the server (or on the way to it).

    Attributes:
        code: the gRPC status code.
        message: the server's message.
        reason: ErrorInfo.reason, a stable machine-readable cause, if the server sent one.
        domain: ErrorInfo.domain ("pooling.v1" for this service).
        metadata: ErrorInfo.metadata, extra key/values about the cause.
        field_violations: BadRequest.field_violations, the offending request fields.
        retry_delay: RetryInfo.retry_delay in seconds, when the server suggests retrying.
    """

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        *,
        reason: str | None = None,
        domain: str | None = None,
        metadata: dict[str, str] | None = None,
        field_violations: list[FieldViolation] | None = None,
        retry_delay: float | None = None,
    ) -> None:
        # args stay (code, message) so the default Exception pickling round-trips.
        super().__init__(code, message)
        self.code = code
        self.message = message
        self.reason = reason
        self.domain = domain
        self.metadata = dict(metadata or {})
        self.field_violations = list(field_violations or [])
        self.retry_delay = retry_delay

    def __str__(self) -> str:
        text = f"{self.code.name}: {self.message}"
        if self.reason:
            text += f" [reason={self.reason}]"
        if self.field_violations:
            violations = "; ".join(f"{v.field}: {v.description}" for v in self.field_violations)
            text += f" (field violations: {violations})"
        if self.retry_delay is not None:
            text += f" (retry after {self.retry_delay:g}s)"
        return text

    @classmethod
    def from_status(cls, status: status_pb2.Status) -> PoolingError:
        """Build from a google.rpc.Status, e.g. an in-band PoolStreamResponse.error."""
        code = _CODES_BY_VALUE.get(status.code, grpc.StatusCode.UNKNOWN)
        return cls._from_parts(code, status.message, status)

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> PoolingError:
        """Build from a failed call (sync or grpc.aio), decoding the status details trailer."""
        code = _call_attr(error, "code") or grpc.StatusCode.UNKNOWN
        status = _status_from_metadata(_call_attr(error, "trailing_metadata"))
        # The call's own code and message win; the trailer adds the details.
        message = _call_attr(error, "details") or (status.message if status else "") or str(error)
        return cls._from_parts(code, message, status)

    @classmethod
    def _from_parts(
        cls, code: grpc.StatusCode, message: str, status: status_pb2.Status | None
    ) -> PoolingError:
        error = cls(code, message)
        if status is not None:
            error._add_details(status.details)
        return error

    def _add_details(self, details: Iterable[Any]) -> None:
        """Unpack the ErrorInfo, BadRequest and RetryInfo details; others are ignored."""
        for detail in details:
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                self.reason = info.reason or None
                self.domain = info.domain or None
                self.metadata = dict(info.metadata)
            elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                bad_request = error_details_pb2.BadRequest()
                detail.Unpack(bad_request)
                self.field_violations.extend(
                    FieldViolation(v.field, v.description, v.reason)
                    for v in bad_request.field_violations
                )
            elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                retry = error_details_pb2.RetryInfo()
                detail.Unpack(retry)
                delay = retry.retry_delay
                self.retry_delay = delay.seconds + delay.nanos / 1e9


def _call_attr(error: grpc.RpcError, name: str) -> Any:
    """Call ``error.<name>()`` if the error is also a grpc.Call, else None."""
    method = getattr(error, name, None)
    if method is None:
        return None
    try:
        return method()
    except Exception:  # a half-built error object; fall back to the defaults
        return None


def _status_from_metadata(metadata: Any) -> status_pb2.Status | None:
    """Find and parse the grpc-status-details-bin entry of trailing metadata."""
    for key, value in metadata or ():
        if key == STATUS_DETAILS_KEY:
            try:
                return status_pb2.Status.FromString(value)
            except DecodeError:  # a malformed trailer must not hide the original error
                return None
    return None
