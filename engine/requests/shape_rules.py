"""The rules of a request's own shape, before its model is asked: an input case given and
not empty, score's sides that pair, the number of inputs, and the request id (echoed in
answers and logs, so bounded; on a stream, also what pairs an answer with its request)."""

from __future__ import annotations

from collections.abc import Iterator, Set

from pooling_server.engine.errors import ErrorKind, FieldViolation, PoolingError
from pooling_server.engine.requests.params import Task
from pooling_server.engine.requests.resolved import Limits, Resolved, list_path

INPUT_CASES = ", ".join(task.value for task in Task)


# Identifiers are echoed in answers and logs: bounded, so neither can be made huge.
MAX_REQUEST_ID_BYTES = 256
MAX_MODEL_NAME_CHARS = 256


def input_present(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
    request = r.request
    if request.task is None:
        yield FieldViolation("input", f"set one input case: {INPUT_CASES}", "INPUT_MISSING")


def input_not_empty(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
    request = r.request
    if request.task is None:
        return
    if request.task is Task.SCORE:
        for name in ("text_1", "text_2"):
            items = f"items_{name[-1]}"
            if not getattr(request, name) and not getattr(request, items):
                yield FieldViolation(f"score.{name}", "must hold at least one text", "EMPTY_INPUT")
    elif not request.texts and not request.items:
        yield FieldViolation(f"{request.task}.texts", "must hold at least one text", "EMPTY_INPUT")


def score_shape(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
    request = r.request
    n1 = len(request.text_1 or request.items_1)
    n2 = len(request.text_2 or request.items_2)
    if request.task is Task.SCORE and n1 and n2 and n1 != 1 and n1 != n2:
        second = "score.items_2" if request.items_2 else "score.text_2"
        yield FieldViolation(
            second,
            f"the first side has {n1} inputs and the second {n2}: send one first input (1:N) "
            "or as many first inputs as second (N:N)",
            "SCORE_SHAPE_MISMATCH",
        )


def batch_size(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
    request = r.request
    if request.task is not None and request.num_items > limits.max_client_batch_size:
        path = list_path(request)
        yield too_many_inputs(path, request.num_items, limits.max_client_batch_size)


def too_many_inputs(path: str, count: int | None, limit: int) -> FieldViolation:
    """The violation of a list over the per-request limit. The doors count on the wire,
    before any text is built: gRPC stops counting at limit + 1 (`count` None)."""
    counted = f"more than {limit}" if count is None else str(count)
    return FieldViolation(
        path,
        f"{counted} inputs exceed the limit of {limit} per request "
        "(--max-client-batch-size); split the request or use PoolStream",
        "TOO_MANY_INPUTS",
    )


def request_id_too_long(request_id: str) -> bool:
    return len(request_id.encode()) > MAX_REQUEST_ID_BYTES


def request_id(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
    request = r.request
    if request_id_too_long(request.request_id):
        yield FieldViolation(
            "request_id",
            f"request_id has {len(request.request_id.encode())} bytes, more than "
            f"{MAX_REQUEST_ID_BYTES}",
            "REQUEST_ID_TOO_LONG",
        )


def stream_request_id_error(request_id: str, seen: Set[str], index: int) -> PoolingError | None:
    """The rule for the id of stream message `index`: present, not too long, and not one
    an earlier message of the stream used (`seen`), since answers come back in any order
    and the id is all that pairs them with their requests."""
    too_long = request_id_too_long(request_id)
    if request_id and request_id not in seen and not too_long:
        return None
    metadata = {}
    if not request_id:
        reason, problem = "REQUEST_ID_MISSING", "request_id is required on a stream"
    elif too_long:
        reason = "REQUEST_ID_TOO_LONG"
        problem = f"request_id has more than {MAX_REQUEST_ID_BYTES} bytes"
    else:
        reason, problem = "REQUEST_ID_DUPLICATE", "request_id repeats an earlier request_id"
        metadata["request_id"] = request_id
    return PoolingError(
        ErrorKind.INVALID_ARGUMENT,
        reason,
        problem,
        (FieldViolation(f"messages[{index}].request.request_id", problem, reason),),
        metadata=metadata,
    )


def task_agrees(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
    request = r.request
    declared = request.declared_task
    if declared is not None and request.task is not None and declared is not request.task:
        yield FieldViolation(
            "params.task",
            f"task {declared} disagrees with the input case {request.task}",
            "TASK_MISMATCH",
        )
