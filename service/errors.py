"""Engine errors as gRPC statuses (codes with google.rpc details), and the status a metric
or log line carries; the codes and statuses themselves are service/error_table.py's."""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import Message
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from engine.errors import ErrorKind, PoolingError
from service.error_table import TABLE, grpc_code

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
