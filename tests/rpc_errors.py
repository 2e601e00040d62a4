"""Decoding google.rpc error details from a failed call, as any client would."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status


@dataclass
class DecodedError:
    code: grpc.StatusCode
    message: str
    info: error_details_pb2.ErrorInfo | None
    bad_request: error_details_pb2.BadRequest | None
    retry: error_details_pb2.RetryInfo | None

    @property
    def reason(self) -> str | None:
        return self.info.reason if self.info else None

    @property
    def fields(self) -> list[str]:
        return [v.field for v in self.bad_request.field_violations] if self.bad_request else []

    def description(self, field: str) -> str:
        assert self.bad_request is not None
        return next(v.description for v in self.bad_request.field_violations if v.field == field)


def decode_status(status: status_pb2.Status) -> DecodedError:
    found: dict[type, object] = {}
    for detail in status.details:
        for kind in (
            error_details_pb2.ErrorInfo,
            error_details_pb2.BadRequest,
            error_details_pb2.RetryInfo,
        ):
            if detail.Is(kind.DESCRIPTOR):
                message = kind()
                detail.Unpack(message)
                found[kind] = message
    return DecodedError(
        next(c for c in grpc.StatusCode if c.value[0] == status.code),
        status.message,
        found.get(error_details_pb2.ErrorInfo),  # type: ignore[arg-type]
        found.get(error_details_pb2.BadRequest),  # type: ignore[arg-type]
        found.get(error_details_pb2.RetryInfo),  # type: ignore[arg-type]
    )


def decode_rpc_error(error: grpc.RpcError) -> DecodedError:
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    if status is None:
        return DecodedError(error.code(), error.details() or "", None, None, None)  # type: ignore[attr-defined]
    return decode_status(status)
