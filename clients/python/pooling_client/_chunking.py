"""Splitting a big job into chunks sent over PoolStream, and putting the answers back together.

Pure logic only (no I/O), shared by the sync and async clients: they decide *whether* to
stream and move messages; this module decides *what* to send, bounds how much is unanswered,
and reassembles the out-of-order answers in input order.

A job of N inputs (texts, or text pairs for score) with chunk size C becomes ceil(N / C)
``PoolRequest`` messages, built lazily from the input list as room frees up, so a million
texts never exist as a million-text request. Each chunk gets the stream-unique request id
``f"{base}-{chunk_index}"``; the outputs are relabelled ``f"{base}-{input_index}"`` so they
look exactly like the outputs of one unary ``Pool`` call with request id ``base``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pooling_client import _requests
from pooling_client.errors import PoolingError
from pooling_client.outputs import PoolingResults, Usage
from pooling_client.v1 import pooling_pb2

Inputs = list[str] | tuple[list[str], list[str]]

#: Calls with at most this many inputs (and no more than the client's batch_size) go out as
#: one unary Pool without asking the server for its limits, so small calls never pay an
#: extra round trip. Every server accepts at least this many inputs per request in practice.
STREAM_THRESHOLD = 32
#: Chunk size when neither the client nor the server names one.
DEFAULT_CHUNK_SIZE = 256
#: Chunks in flight when the server does not report max_stream_inflight.
DEFAULT_CHUNKS_IN_FLIGHT = 4


@dataclass(frozen=True)
class StreamLimits:
    """The server's request and stream limits (0 means the server did not say)."""

    max_client_batch_size: int = 0
    max_stream_inflight: int = 0

    @classmethod
    def from_proto(cls, response: pooling_pb2.ListModelsResponse) -> StreamLimits:
        """Read the limits off a ListModelsResponse."""
        return cls(max(response.max_client_batch_size, 0), max(response.max_stream_inflight, 0))


def check_batch_size(batch_size: int | None) -> int | None:
    """Validate the client's ``batch_size`` option (None: the server's limit)."""
    if batch_size is None:
        return None
    if isinstance(batch_size, bool) or not isinstance(batch_size, int):
        raise TypeError(f"batch_size must be an int or None, got {type(batch_size).__name__}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return batch_size


def input_count(task: str, inputs: Inputs) -> int | None:
    """How many outputs the job produces, or None when it cannot be chunked.

    Score chunks only in the shapes vLLM defines: 1:N (text_2 is chunked, the single text_1
    goes with every chunk) and N:N (both are chunked in step). Other shapes are left to the
    unary call, so the server reports the mismatch as it always does.
    """
    if task != "score":
        return len(inputs)
    text_1, text_2 = inputs
    if len(text_1) == 1:
        return len(text_2)
    if len(text_1) == len(text_2):
        return len(text_1)
    return None


def needs_limits(count: int, batch_size: int | None) -> bool:
    """Whether a job this big might be chunked, so the server's limits are worth fetching."""
    threshold = STREAM_THRESHOLD if batch_size is None else min(batch_size, STREAM_THRESHOLD)
    return count > threshold


def chunk_size(batch_size: int | None, limits: StreamLimits) -> int:
    """min(batch_size or the server's limit, the server's limit), at least 1."""
    server = limits.max_client_batch_size or None
    size = batch_size or server or DEFAULT_CHUNK_SIZE
    if server is not None:
        size = min(size, server)
    return max(size, 1)


def chunks_in_flight(size: int, limits: StreamLimits) -> int:
    """How many chunks may be unanswered at once without the server pausing the stream."""
    if limits.max_stream_inflight <= 0:
        return DEFAULT_CHUNKS_IN_FLIGHT
    return max(1, limits.max_stream_inflight // size)


def empty_inputs(task: str) -> Inputs:
    """No inputs, in the shape ``task`` takes; for building a template request."""
    return ([], []) if task == "score" else []


def whole_request(
    template: pooling_pb2.PoolRequest, task: str, inputs: Inputs
) -> pooling_pb2.PoolRequest:
    """The template request carrying all of ``inputs``: the unary Pool request."""
    request = pooling_pb2.PoolRequest()
    request.CopyFrom(template)
    _requests.set_inputs(request, task, inputs)
    return request


def plan(
    task: str,
    inputs: Inputs,
    template: pooling_pb2.PoolRequest,
    batch_size: int | None,
    limits: StreamLimits,
) -> ChunkedJob | None:
    """A ChunkedJob when the inputs need more than one chunk, else None (send one Pool)."""
    count = input_count(task, inputs)
    size = chunk_size(batch_size, limits)
    if count is None or count <= size:
        return None
    return ChunkedJob(task, inputs, template, size, chunks_in_flight(size, limits))


def iter_chunks(task: str, inputs: Inputs, size: int) -> Iterator[tuple[int, Inputs]]:
    """Yield (offset, chunk inputs) lazily, slicing the input lists as it goes."""
    count = input_count(task, inputs)
    if count is None:
        raise ValueError("score inputs must be 1:N or N:N to be chunked")
    for offset in range(0, count, size):
        end = offset + size
        if task != "score":
            yield offset, inputs[offset:end]
            continue
        text_1, text_2 = inputs
        if len(text_1) == 1:
            yield offset, (text_1, text_2[offset:end])
        else:
            yield offset, (text_1[offset:end], text_2[offset:end])


@dataclass
class _Pending:
    offset: int
    count: int


class ChunkedJob:
    """One task over many inputs, as a bounded window of chunks on one PoolStream.

    Drive it with :meth:`fill` (requests to send now), :meth:`accept` (each response) and
    :meth:`outputs` (the reassembled result once :attr:`done`).

    Args:
        task: the pooling task.
        inputs: the whole job's inputs (texts, or (text_1, text_2) for score).
        template: a verified PoolRequest carrying model and params but no inputs; its
            request_id is the job's base id.
        size: inputs per chunk.
        window: the most chunks unanswered at once.
    """

    def __init__(
        self,
        task: str,
        inputs: Inputs,
        template: pooling_pb2.PoolRequest,
        size: int,
        window: int,
    ) -> None:
        if size < 1 or window < 1:
            raise ValueError(f"chunk size and window must be >= 1, got {size} and {window}")
        count = input_count(task, inputs)
        if count is None:
            raise ValueError("score inputs must be 1:N or N:N to be chunked")
        self.task = task
        self.total = count
        self.size = size
        self.window = window
        self.base_id = template.request_id
        self._template = template
        self._chunks = iter_chunks(task, inputs, size)
        self._next_index = 0
        self._exhausted = False
        self._pending: dict[str, _Pending] = {}
        self._results: list[Any] = [None] * count
        self._answered = 0
        self._prompt_tokens = 0
        self._total_tokens = 0
        self._cached_tokens = 0

    @property
    def in_flight(self) -> int:
        """Chunks handed out by :meth:`fill` and not yet answered."""
        return len(self._pending)

    @property
    def exhausted(self) -> bool:
        """Whether every chunk has been handed out (the request side can be closed)."""
        return self._exhausted

    @property
    def done(self) -> bool:
        """Whether every chunk has been handed out and answered."""
        return self._exhausted and not self._pending

    def fill(self) -> list[pooling_pb2.PoolStreamRequest]:
        """The next chunks to send, enough to bring the unanswered count up to the window."""
        requests: list[pooling_pb2.PoolStreamRequest] = []
        while not self._exhausted and len(self._pending) < self.window:
            chunk = next(self._chunks, None)
            if chunk is None:
                self._exhausted = True
                break
            offset, chunk_inputs = chunk
            stream_id = f"{self.base_id}-{self._next_index}"
            self._next_index += 1
            request = pooling_pb2.PoolRequest()
            request.CopyFrom(self._template)
            request.request_id = stream_id
            _requests.set_inputs(request, self.task, chunk_inputs)
            self._pending[stream_id] = _Pending(offset, _requests.expected_outputs(request))
            requests.append(pooling_pb2.PoolStreamRequest(request=request))
        if not self._exhausted and self._next_index * self.size >= self.total:
            self._exhausted = True  # the last chunk went out; no need to wait for a refill
        return requests

    def accept(self, response: pooling_pb2.PoolStreamResponse) -> int:
        """Take one stream response; returns how many inputs it answered.

        Raises PoolingError for an in-band error, ValueError for a response that answers no
        chunk in flight or does not fit its chunk.
        """
        pending = self._pending.pop(response.request_id, None)
        if pending is None:
            raise ValueError(
                f"PoolStream answered request_id {response.request_id!r}, which is not in flight"
            )
        case = response.WhichOneof("result")
        if case == "error":
            raise PoolingError.from_status(response.error)
        if case != "response":
            raise ValueError(f"PoolStreamResponse {response.request_id!r} carries no result")
        outputs = _requests.convert_outputs(self.task, response.response, pending.count)
        self._prompt_tokens += response.response.usage.prompt_tokens
        self._total_tokens += response.response.usage.total_tokens
        self._cached_tokens += response.response.usage.cached_tokens
        for i, output in enumerate(outputs, start=pending.offset):
            output.request_id = f"{self.base_id}-{i}"
            self._results[i] = output
        self._answered += pending.count
        return pending.count

    def outputs(self) -> PoolingResults[Any]:
        """Every output in input order, with the chunks' usage summed; raises ValueError if
        any chunk went unanswered."""
        if not self.done:
            raise ValueError(
                f"PoolStream ended with {self.total - self._answered} of {self.total} inputs "
                "unanswered"
            )
        usage = Usage(self._prompt_tokens, self._total_tokens, self._cached_tokens)
        return PoolingResults(self._results, usage)
