"""Messages between front-end processes and an engine process, over ZMQ.

A message is a msgpack header (msgspec structs, encoded as arrays) followed by raw array
frames: token ids go one way and raw outputs come back as contiguous buffers that the
receiver views without copying, never as pickled per-item objects. Times are
time.monotonic() values, which every process on one host shares.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np

from engine.errors import ErrorKind, FieldViolation, PoolingError, internal_error
from engine.served import ModelDescription

IDS = np.dtype("<i4")
OUTPUTS = np.dtype("<f4")


class JobHeader(msgspec.Struct, array_like=True):
    id: int
    model: str
    deadline: float | None
    keep_tokens: bool
    lengths: list[int]  # tokens of each sequence, in order; ids (and types) are concatenated
    client: str = ""  # who asked, within the sending front end (Job.client)


class Submit(msgspec.Struct, array_like=True, tag=0):
    """Frames: the concatenated token ids, then (if with_types) the token type ids."""

    reply_to: str
    origin: int
    with_types: bool
    jobs: list[JobHeader]


class Cancel(msgspec.Struct, array_like=True, tag=1):
    reply_to: str
    ids: list[int]


class ErrorInfo(msgspec.Struct, array_like=True):
    kind: str
    reason: str
    message: str
    retry_after_s: float | None = None
    violations: list[tuple[str, str, str]] = []
    metadata: dict[str, str] = {}

    @classmethod
    def of(cls, error: BaseException) -> ErrorInfo:
        if not isinstance(error, PoolingError):  # a bug, logged in the engine process
            error = internal_error()
        violations = [(v.field, v.description, v.reason) for v in error.violations]
        return cls(
            error.kind, error.reason, error.message, error.retry_after_s, violations, error.metadata
        )

    def error(self) -> PoolingError:
        violations = tuple(FieldViolation(*v) for v in self.violations)
        return PoolingError(
            ErrorKind(self.kind),
            self.reason,
            self.message,
            violations,
            dict(self.metadata),
            self.retry_after_s,
        )


class JobResult(msgspec.Struct, array_like=True):
    """One job's raw outputs (shapes in order; values in the data frame) or its error."""

    id: int
    shapes: list[list[int]]
    error: ErrorInfo | None
    enqueued: float
    started: float | None
    finished: float | None


class Results(msgspec.Struct, array_like=True):
    """Frame: every result's outputs as one float32 buffer, in order."""

    results: list[JobResult]


class EngineReady(msgspec.Struct):
    """Written by an engine process once its models are loaded and warm."""

    address: str
    pid: int
    models: list[ModelDescription]


ToEngine = Submit | Cancel
to_engine_decoder = msgspec.msgpack.Decoder(ToEngine)
results_decoder = msgspec.msgpack.Decoder(Results)
encoder = msgspec.msgpack.Encoder()


def unpack_outputs(
    buffer: np.ndarray, offset: int, shapes: Sequence[Sequence[int]]
) -> tuple[list[np.ndarray], int]:
    """Views into `buffer` (no copy) for one job's outputs; returns the offset after them."""
    arrays = []
    for shape in shapes:
        size = int(np.prod(shape))
        arrays.append(buffer[offset : offset + size].reshape(shape))
        offset += size
    return arrays, offset
