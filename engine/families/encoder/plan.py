"""A pooled text encoder's plans: a vector per text (or per late chunk), a row per token,
and score as the cosine of two embeddings."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from pooling_server.engine.errors import ErrorKind, FieldViolation, PoolingError
from pooling_server.engine.families.encoder.settings import score_refusal
from pooling_server.engine.models.model_info import ModelInfo
from pooling_server.engine.models.served import ServedModel
from pooling_server.engine.requests.heads import cosine, normalize, truncate_dimensions
from pooling_server.engine.requests.late_chunking import plan_late_chunking
from pooling_server.engine.requests.outputs import Embedding, ItemOutput, Score, TokenRows
from pooling_server.engine.requests.params import OutputEncoding, Task
from pooling_server.engine.requests.plan_parts import (
    Plan,
    encoded,
    finish_vector,
    use_activation,
)
from pooling_server.engine.requests.plans import (
    TextParts,
    pair_index,
    plan_per_text,
    plan_texts,
    pooled_vector,
    rows_output,
    token_rows,
    tokenize_texts,
)
from pooling_server.engine.requests.request import PoolRequest
from pooling_server.engine.requests.resolved import Limits, Resolved


def plan(resolved: Resolved, model: ServedModel, limits: Limits) -> Plan:
    """A decoder LM served without a score template refuses score (settings.score_refusal)."""
    request = resolved.request
    refusal = score_refusal(request.task, model.info) if request.task is not None else None
    if refusal is not None:
        raise _no_score_template(refusal)
    if request.late_chunking is not None:  # embed only (validation refuses the rest)
        return Plan(*plan_late_chunking(resolved, model, limits))
    if request.task is Task.SCORE:
        return _plan_cosine(resolved, model, limits)
    if request.task is Task.TOKEN_EMBED:
        return plan_per_text(resolved, model, limits, _token_vectors, keep_tokens=True)
    return plan_per_text(resolved, model, limits, _vector)


def _vector(
    request: PoolRequest, info: ModelInfo, text: TextParts, raws: list[np.ndarray]
) -> Embedding:
    return finish_vector(request, info, pooled_vector(text, raws))


def _token_vectors(
    request: PoolRequest, info: ModelInfo, text: TextParts, raws: list[np.ndarray]
) -> TokenRows:
    values = truncate_dimensions(token_rows(text, raws), request.params.dimensions)
    if use_activation(request, info.default_normalize):
        values = normalize(values)
    rows = rows_output(text, values)
    if request.encoding is OutputEncoding.FLOAT:
        return rows
    return replace(rows, encoding=request.encoding, data=encoded(request, info, rows.values))


def _plan_cosine(resolved: Resolved, model: ServedModel, limits: Limits) -> Plan:
    """Embed every text once, then the cosine similarity of each pair, in float32."""
    request = resolved.request
    firsts = tokenize_texts(resolved, model, limits, request.text_1, "score.text_1")
    seconds = tokenize_texts(resolved, model, limits, request.text_2, "score.text_2")
    vectors = plan_texts(
        firsts + seconds, False, lambda text, raws: Embedding(pooled_vector(text, raws))
    )

    def finish(raws: list[np.ndarray]) -> list[ItemOutput]:
        embedded = [e.values for e in vectors.finish(raws)]  # type: ignore[union-attr]
        first, second = embedded[: len(firsts)], embedded[len(firsts) :]
        return [Score(cosine(first[i], second[j])) for i, j in pair_index(request)]

    return Plan(vectors.work, finish)


def _no_score_template(violation: FieldViolation) -> PoolingError:
    error = PoolingError.invalid([violation])
    error.kind = ErrorKind.FAILED_PRECONDITION
    return error
