"""Late chunking's rules (its plan is late_chunking.py): the shape of the chunking a
request asks for, and a model that pools by mean, since a chunk's vector averages its
token states."""

from __future__ import annotations

from collections.abc import Iterator

from pooling_server.engine.errors import FieldViolation
from pooling_server.engine.models.model_info import HeadKind, PoolingType
from pooling_server.engine.requests.params import Task
from pooling_server.engine.requests.request import ChunkRule
from pooling_server.engine.requests.resolved import Limits, Resolved
from pooling_server.engine.requests.shape_rules import too_many_inputs


def chunking_shape(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
    """Late chunking's shape: embed only, spans or a rule (not both), the rule's window and
    overlap in range, and spans of the one text, each non-empty and inside it. Spans may
    overlap and come in any order (each chunk is computed on its own)."""
    request, chunking = r.request, r.request.late_chunking
    if chunking is None:
        return
    path = "late_chunking"
    if request.task is not Task.EMBED:
        yield FieldViolation(
            path,
            f"late chunking embeds chunks of a text: it applies to embed only, not {request.task}",
            "LATE_CHUNKING_TASK",
        )
        return
    if request.params.truncate_prompt_tokens is not None:
        yield FieldViolation(
            "params.truncate_prompt_tokens",
            "late chunking reads the whole text (in macro-windows past the maximum length): "
            "leave truncate_prompt_tokens unset",
            "LATE_CHUNKING_TRUNCATE",
        )
    if bool(chunking.spans) == (chunking.rule is not None):
        yield FieldViolation(
            path,
            "give either spans or a rule (sentences, or tokens with a window), not "
            + ("both" if chunking.spans else "neither"),
            "LATE_CHUNKING_SHAPE",
        )
        return
    if chunking.rule is ChunkRule.TOKENS:
        if chunking.window < 1:
            yield FieldViolation(
                f"{path}.window",
                f"the tokens rule needs a window of at least 1 token, got {chunking.window}",
                "LATE_CHUNKING_WINDOW",
            )
        elif not 0 <= chunking.overlap < chunking.window:
            yield FieldViolation(
                f"{path}.overlap",
                f"overlap must be from 0 to window - 1 ({chunking.window - 1}), "
                f"got {chunking.overlap}",
                "LATE_CHUNKING_OVERLAP",
            )
    elif chunking.window or chunking.overlap:
        yield FieldViolation(
            f"{path}.window",
            "window and overlap belong to the tokens rule; leave them unset",
            "LATE_CHUNKING_WINDOW",
        )
    if not chunking.spans:
        return
    if len(request.texts) != 1:
        yield FieldViolation(
            f"{path}.spans",
            f"spans are character spans of one text, and the request has {len(request.texts)}; "
            "send one text per request, or use a rule",
            "LATE_CHUNKING_SPANS_TEXTS",
        )
        return
    if len(chunking.spans) > limits.max_client_batch_size:
        yield too_many_inputs(f"{path}.spans", len(chunking.spans), limits.max_client_batch_size)
        return
    length = len(request.texts[0])
    for i, (start, end) in enumerate(chunking.spans):
        if start < 0 or end > length:
            problem, reason = f"lies outside the text of {length} characters", "SPAN_OUT_OF_TEXT"
        elif start > end:
            problem, reason = "ends before it starts", "SPAN_REVERSED"
        elif start == end:
            problem, reason = "is empty", "SPAN_EMPTY"
        else:
            continue
        yield FieldViolation(f"{path}.spans[{i}]", f"[{start}, {end}) {problem}", reason)


def chunking_pooling(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
    """A chunk's vector is the mean of its token states: the model must pool by mean."""
    request, info = r.request, r.info
    if request.late_chunking is None or request.task is not Task.EMBED:
        return
    if info.head is not HeadKind.HIDDEN or info.pooling_type is not PoolingType.MEAN:
        yield FieldViolation(
            "late_chunking",
            f'model "{info.name}" pools by {info.pooling_type}, and late chunking averages '
            "token states: it needs a model with mean pooling",
            "LATE_CHUNKING_POOLING",
        )
