"""Plans on a ColBERT model: embed_multi in query or document mode, and score (so Rerank)
by MaxSim over the two modes' matrices. Torch-free: front ends plan and finish with it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pooling_server.engine.families.colbert.multi_vector import (
    MultiVectorSettings,
    maxsim,
    query_mode,
)
from pooling_server.engine.inputs.tokenization import TokenSequence
from pooling_server.engine.models.served import ServedModel
from pooling_server.engine.requests.heads import normalize
from pooling_server.engine.requests.outputs import ItemOutput, MultiVector, Score
from pooling_server.engine.requests.params import OutputEncoding, Task
from pooling_server.engine.requests.plan_parts import Plan, encoded
from pooling_server.engine.requests.plans import TextParts, pair_index, plan_text, plan_texts
from pooling_server.engine.requests.resolved import Limits, Resolved
from pooling_server.engine.requests.size_rules import check_tokenized


def plan(resolved: Resolved, model: ServedModel, limits: Limits) -> Plan:
    """embed_multi, and score by MaxSim; any other task as a text model plans it (the rules
    refuse them before planning)."""
    task = resolved.request.task
    if task is Task.SCORE:
        return _plan_maxsim(resolved, model, limits)
    if task is Task.EMBED_MULTI:
        return _plan_multi(resolved, model, limits)
    return plan_text(resolved, model, limits)


def _settings(model: ServedModel) -> MultiVectorSettings:
    settings = model.info.settings
    assert isinstance(settings, MultiVectorSettings)
    return settings


def _texts(
    resolved: Resolved,
    model: ServedModel,
    limits: Limits,
    texts: Sequence[str],
    query: bool,
    path: str,
) -> list[TextParts]:
    """Texts in one mode, as PyLate / MultiVectorEncoder tokenize them: the mode's prefix;
    queries cut to query_length and filled up to it with mask tokens (expansion), documents
    cut to document_length (or the request's truncation, when shorter)."""
    settings = _settings(model)
    prompt = resolved.prompt
    if prompt is None or resolved.request.task is Task.SCORE:
        prompt = settings.query_prefix if query else settings.document_prefix
    limit = settings.kept_tokens(query, resolved.truncate, model.info.max_input_tokens)
    sequences = model.tokenizer.tokenize(
        [prompt + t for t in texts], truncate=limit, side=resolved.side
    )
    check_tokenized(resolved, limits, path, [len(e) for e in sequences])
    if query and settings.query_expansion and settings.query_length:
        sequences = [_expand(e, settings) for e in sequences]
    return [TextParts(e, [e]) for e in sequences]


def _expand(sequence: TokenSequence, settings: MultiVectorSettings) -> TokenSequence:
    """Fill a query up to query_length with the mask token (ColBERT's query expansion)."""
    missing = (settings.query_length or 0) - len(sequence)
    if missing <= 0:
        return sequence
    end = sequence.offsets[-1][1] if sequence.offsets else 0
    return TokenSequence(
        sequence.input_ids + [settings.mask_token_id] * missing,
        None if sequence.token_type_ids is None else sequence.token_type_ids + [0] * missing,
        sequence.offsets + [(end, end)] * missing,
        sequence.special_mask + [1] * missing,
    )


def _matrix(
    settings: MultiVectorSettings, text: TextParts, rows: np.ndarray, query: bool
) -> np.ndarray:
    """The normalised rows a text keeps: every query row; a document's without the
    skiplist's tokens."""
    rows = normalize(rows.astype(np.float32))
    if query or not settings.skiplist_ids:
        return rows
    keep = ~np.isin(np.asarray(text.sequence.input_ids), settings.skiplist_ids)
    return np.ascontiguousarray(rows[keep])


def _plan_multi(resolved: Resolved, model: ServedModel, limits: Limits) -> Plan:
    """embed_multi: prompt_name "query" gives query mode, anything else document mode."""
    request, info = resolved.request, model.info
    settings = _settings(model)
    query = query_mode(request.prompt_name, request.prompt, info.default_prompt_name)
    texts = _texts(resolved, model, limits, request.texts, query, "embed_multi.texts")

    def finish_one(text: TextParts, raws: list[np.ndarray]) -> MultiVector:
        values = _matrix(settings, text, raws[0], query)
        if request.encoding is OutputEncoding.FLOAT:
            return MultiVector(values)
        return MultiVector(values, request.encoding, encoded(request, info, values))

    return plan_texts(texts, True, finish_one)


def _plan_maxsim(resolved: Resolved, model: ServedModel, limits: Limits) -> Plan:
    """score (and so Rerank): text_1 as queries, text_2 as documents, each encoded once,
    then MaxSim per pair. Computed where the plan finishes, in numpy: the matrices are
    small (tens of rows) and already on the host for the response path, so a device round
    trip would cost more than the products."""
    request, settings = resolved.request, _settings(model)
    queries = _texts(resolved, model, limits, request.text_1, True, "score.text_1")
    documents = _texts(resolved, model, limits, request.text_2, False, "score.text_2")
    texts = queries + documents
    work = [(text.sequence, True) for text in texts]
    pairs = pair_index(request)
    first: dict[int, np.ndarray] = {}  # each query's matrix, once computed

    def fold(index: int, raw: np.ndarray) -> _Folded:
        """As each batch ends: a query's matrix is kept; a document is scored at once
        where its query is in (a query is its job's first sequence, so it usually is),
        so a thousand documents' matrices are never all held."""
        if index < len(queries):
            first[index] = matrix = _matrix(settings, texts[index], raw, True)
            return _Folded(matrix)
        document = _matrix(settings, texts[index], raw, False)
        query = first.get(pairs[index - len(queries)][0])
        return _Folded(document if query is None else maxsim(query, document))

    def finish(raws: list[np.ndarray | _Folded]) -> list[ItemOutput]:
        done = [r.value if type(r) is _Folded else fold(k, r).value for k, r in enumerate(raws)]
        scores = []
        for i, j in pairs:
            document = done[len(queries) + j]
            scored = isinstance(document, float)
            scores.append(Score(document if scored else maxsim(done[i], document)))  # type: ignore[arg-type]
        return scores

    return Plan(work, finish, fold)


@dataclass(frozen=True, slots=True)
class _Folded:
    """A MaxSim sequence's output as its fold left it: a matrix, or a document's score."""

    value: np.ndarray | float
