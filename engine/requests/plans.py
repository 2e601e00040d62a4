"""Per task: which sequences a request needs computed, and how raw outputs become results.

Pooling methods ran in the model runner; here the heads (matryoshka truncation,
normalisation, activations) and chunk merging are applied per item, so one batch
can mix requests with different parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass, replace

import numpy as np

from pooling_server.engine.errors import ErrorKind, FieldViolation, PoolingError
from pooling_server.engine.families import family_of
from pooling_server.engine.families.bge_m3.multi_output import (
    colbert,
    colbert_score,
    combined,
    dense,
    lexical,
    lexical_score,
    weighted_outputs,
)
from pooling_server.engine.families.colbert.multi_vector import QUERY, MultiVectorSettings, maxsim
from pooling_server.engine.inputs.tokenization import TokenSequence, special_edges
from pooling_server.engine.models.model_info import (
    Activation,
    ModelInfo,
    PoolingType,
    SpladeStrategy,
)
from pooling_server.engine.models.served import ServedModel
from pooling_server.engine.requests.heads import (
    activate,
    cosine,
    normalize,
    saturate,
    truncate_dimensions,
)
from pooling_server.engine.requests.late_chunking import plan_late_chunking
from pooling_server.engine.requests.outputs import (
    Classification,
    Embedding,
    ItemOutput,
    MultiVector,
    Score,
    SparseEmbedding,
    TextOutputs,
    TokenRows,
)
from pooling_server.engine.requests.params import Output, OutputEncoding, Task
from pooling_server.engine.requests.plan_parts import Plan, encoded, finish_vector, use_activation
from pooling_server.engine.requests.request import PoolRequest
from pooling_server.engine.requests.validation import (
    TOKEN_TASKS,
    Limits,
    Resolved,
    check_tokenized,
    resolve,
)


@dataclass(frozen=True)
class _Text:
    """One input text: its full token sequence and the sequences computed for it (chunks)."""

    sequence: TokenSequence
    parts: list[TokenSequence]
    # Set where the prompt's tokens are left out of the pooling (include_prompt false):
    # the parts come back as token states, pooled here without the first `skip` tokens.
    pooling: PoolingType | None = None
    skip: int = 0


def plan_request(
    request: Resolved | PoolRequest, model: ServedModel, limits: Limits | None = None
) -> Plan:
    """`request`: as validation resolved it (a bare PoolRequest is resolved here, unchecked);
    `limits`: the engine's, which the tokenized rules check the counts against."""
    resolved = request if isinstance(request, Resolved) else resolve(request, model.info)
    return _plan(resolved, model, limits or Limits())


def _plan(resolved: Resolved, model: ServedModel, limits: Limits) -> Plan:
    return family_of(model.info).plan(resolved, model, limits)


def plan_encoder(resolved: Resolved, model: ServedModel, limits: Limits) -> Plan:
    """A pooled text encoder; a decoder LM served without a score template refuses score."""
    if resolved.request.task is Task.SCORE and model.info.score_refusal:
        raise _no_score_template(model.info)
    return plan_text(resolved, model, limits)


def plan_llm_reranker(resolved: Resolved, model: ServedModel, limits: Limits) -> Plan:
    if resolved.request.task is Task.SCORE:
        return _plan_llm_score(resolved, model, limits)
    return plan_text(resolved, model, limits)


def plan_colbert(resolved: Resolved, model: ServedModel, limits: Limits) -> Plan:
    if resolved.request.task is Task.SCORE:
        return _plan_maxsim(resolved, model, limits)
    return plan_text(resolved, model, limits)


def plan_bge_m3(resolved: Resolved, model: ServedModel, limits: Limits) -> Plan:
    return _plan_multi_output(resolved, model, limits)


def plan_text(resolved: Resolved, model: ServedModel, limits: Limits) -> Plan:
    """The tasks over token sequences: one plan per task."""
    request = resolved.request
    if request.task is Task.EMBED_MULTI:
        return _plan_multi(resolved, model, limits)
    if request.late_chunking is not None:  # embed only (validation refuses the rest)
        return Plan(*plan_late_chunking(resolved, model, limits))
    if request.task is Task.SCORE and model.info.is_cross_encoder:
        return _plan_cross_encoder(resolved, model, limits)
    if request.task is Task.SCORE:
        return _plan_bi_encoder(resolved, model, limits)
    if request.task is Task.EMBED_SPARSE:
        return _plan_sparse(resolved, model, limits)
    texts = _tokenize(resolved, model, limits, request.texts, f"{request.task}.texts")
    keep_tokens = request.task in TOKEN_TASKS  # one row per token of each text
    keep_tokens = keep_tokens or any(text.pooling is not None for text in texts)
    finish_one = _FINISHERS[request.task]
    return _plan_texts(
        texts, keep_tokens, lambda text, raws: finish_one(request, model.info, text, raws)
    )


def _plan_texts(
    texts: list[_Text],
    keep_tokens: bool,
    finish_one: Callable[[_Text, list[np.ndarray]], ItemOutput],
) -> Plan:
    work = [(part, keep_tokens) for text in texts for part in text.parts]

    def finish(raws: list[np.ndarray]) -> list[ItemOutput]:
        outputs, start = [], 0
        for text in texts:
            outputs.append(finish_one(text, raws[start : start + len(text.parts)]))
            start += len(text.parts)
        return outputs

    return Plan(work, finish)


def _tokenize(
    resolved: Resolved,
    model: ServedModel,
    limits: Limits,
    texts: Sequence[str],
    path: str,
    pairs: Sequence[str] | None = None,
) -> list[_Text]:
    """Tokenize one list of inputs as validation resolved the request (prompt, truncation,
    side), check the counts (TOKENIZED_RULES), and chunk what runs past the maximum
    length (only a chunking request gets this far with such a text)."""
    info, prompt = model.info, resolved.prompt
    if prompt:
        texts = [prompt + text for text in texts]
    sequences = model.tokenizer.tokenize(
        texts, pairs, truncate=resolved.truncate, side=resolved.side
    )
    check_tokenized(resolved, limits, path, [len(e) for e in sequences])
    pooling, skip = None, 0
    if prompt and not info.include_prompt and resolved.request.task is Task.EMBED:
        pooling, skip = info.pooling_type, _prompt_length(model, prompt)
    return [
        _Text(e, model.tokenizer.chunk(e) if len(e) > info.max_input_tokens else [e], pooling, skip)
        for e in sequences
    ]


def _prompt_length(model: ServedModel, prompt: str) -> int:
    """The prompt's tokens at the start of a prompted text, as sentence-transformers counts
    them: the prompt tokenized alone, less a trailing special token ([SEP], EOS)."""
    sequence = model.tokenizer.tokenize([prompt])[0]
    return len(sequence) - int(bool(sequence.special_mask and sequence.special_mask[-1]))


def _pool_rows(rows: np.ndarray, skip: int, method: PoolingType) -> np.ndarray:
    """Pool one sequence's token states without its first `skip` tokens, as
    sentence-transformers' Pooling does with include_prompt false (it zeroes their mask)."""
    kept = rows[skip:]
    if method is PoolingType.MEAN:
        return kept.sum(axis=0) / max(len(kept), 1e-9)
    if method is PoolingType.CLS:
        return kept[0] if len(kept) else rows[0]
    if method is PoolingType.LAST:
        return kept[-1] if len(kept) else np.zeros_like(rows[0])
    raise ValueError(f"{method} pooling gives one vector per token, not per sequence")


def _pooled_vector(text: _Text, raws: list[np.ndarray]) -> np.ndarray:
    """One chunk: its vector. Several: their token-weighted mean (vLLM's chunked processing)."""
    if text.pooling is not None:  # token states: pool them here, the prompt left out
        raws = [
            _pool_rows(raw, text.skip if i == 0 else 0, text.pooling) for i, raw in enumerate(raws)
        ]
    if len(raws) == 1:
        return raws[0]
    weights = np.array([len(part) for part in text.parts], dtype=np.float32)
    return (np.stack(raws) * weights[:, None]).sum(axis=0) / weights.sum()


def _token_rows(text: _Text, raws: list[np.ndarray]) -> np.ndarray:
    """Chunks' rows joined back into one row per token of the full text."""
    if len(raws) == 1:
        return raws[0]
    prefix, suffix = special_edges(text.sequence.special_mask)
    rows = [raws[0][:prefix]]
    rows += [raw[prefix : len(raw) - suffix] for raw in raws]
    rows.append(raws[-1][len(raws[-1]) - suffix :])
    return np.concatenate(rows)


def _finish_embed(
    request: PoolRequest, info: ModelInfo, text: _Text, raws: list[np.ndarray]
) -> Embedding:
    return finish_vector(request, info, _pooled_vector(text, raws))


def _finish_token_embed(
    request: PoolRequest, info: ModelInfo, text: _Text, raws: list[np.ndarray]
) -> TokenRows:
    values = truncate_dimensions(_token_rows(text, raws), request.params.dimensions)
    if use_activation(request, info.default_normalize):
        values = normalize(values)
    rows = _rows(text, values)
    if request.encoding is OutputEncoding.FLOAT:
        return rows
    return replace(rows, encoding=request.encoding, data=encoded(request, info, rows.values))


def _class_values(request: PoolRequest, info: ModelInfo, logits: np.ndarray) -> np.ndarray:
    activation = info.activation if use_activation(request, True) else Activation.IDENTITY
    return activate(logits.astype(np.float32), activation)


def _finish_classify(
    request: PoolRequest, info: ModelInfo, text: _Text, raws: list[np.ndarray]
) -> Classification:
    probs = _class_values(request, info, raws[0])
    label_id = int(np.argmax(probs))
    return Classification(probs, label_id, info.label(label_id))


def _finish_token_classify(
    request: PoolRequest, info: ModelInfo, text: _Text, raws: list[np.ndarray]
) -> TokenRows:
    probs = _class_values(request, info, _token_rows(text, raws))
    label_ids = [int(i) for i in np.argmax(probs, axis=-1)]
    return _rows(text, probs, label_ids, [info.label(i) for i in label_ids])


def _rows(
    text: _Text,
    values: np.ndarray,
    label_ids: list[int] | None = None,
    labels: list[str] | None = None,
) -> TokenRows:
    e = text.sequence
    return TokenRows(
        np.ascontiguousarray(values, dtype=np.float32),
        e.input_ids,
        e.offsets,
        e.special_mask,
        label_ids or [],
        labels or [],
    )


_FINISHERS = {
    Task.EMBED: _finish_embed,
    Task.TOKEN_EMBED: _finish_token_embed,
    Task.CLASSIFY: _finish_classify,
    Task.TOKEN_CLASSIFY: _finish_token_classify,
}


def _plan_sparse(resolved: Resolved, model: ServedModel, limits: Limits) -> Plan:
    request = resolved.request
    texts = _tokenize(resolved, model, limits, request.texts, "embed_sparse.texts")
    return _plan_texts(texts, False, lambda text, raws: _finish_sparse(request, model, raws))


def _sparse_weights(info: ModelInfo, raws: list[np.ndarray]) -> np.ndarray:
    """One chunk: its vocabulary vector. Several: for max pooling their elementwise max (the
    max over every token of the text, each token seen in its own window); for sum pooling
    their sum (each chunk's special tokens counted once per chunk)."""
    if len(raws) == 1:
        return raws[0]
    stacked = np.stack(raws)
    return stacked.max(axis=0) if info.splade_strategy is SpladeStrategy.MAX else stacked.sum(0)


def _finish_sparse(
    request: PoolRequest, model: ServedModel, raws: list[np.ndarray]
) -> SparseEmbedding:
    """The non-zero weights by decreasing weight (ties by index), the first top_k of them.

    use_activation (default true) is SPLADE's log saturation: false keeps the max over
    tokens of relu(logits) (max pooling only; validation refuses it for sum pooling)."""
    info = model.info
    weights = _sparse_weights(info, raws)
    if info.splade_strategy is SpladeStrategy.MAX and use_activation(request, True):
        weights = saturate(weights, info.splade_activation)
    indices = np.flatnonzero(weights)
    order = np.argsort(-weights[indices], kind="stable")
    indices = indices[order[: request.sparse_top_k or None]]
    tokens = model.tokenizer.tokens(indices.tolist()) if request.sparse_tokens else []
    return SparseEmbedding(indices.astype(np.int32), weights[indices].astype(np.float32), tokens)


def _pair_index(request: PoolRequest) -> list[tuple[int, int]]:
    """(text_1 index, text_2 index) per pair: 1:N broadcasts the single text_1."""
    one = len(request.text_1) == 1
    return [(0 if one else i, i) for i in range(len(request.text_2))]


def _plan_cross_encoder(resolved: Resolved, model: ServedModel, limits: Limits) -> Plan:
    request = resolved.request
    pairs = _pair_index(request)
    texts = _tokenize(
        resolved,
        model,
        limits,
        [request.text_1[i] for i, _ in pairs],
        "score.text_2",
        [request.text_2[j] for _, j in pairs],
    )
    activation = Activation.SIGMOID if use_activation(request, True) else Activation.IDENTITY

    def finish_one(text: _Text, raws: list[np.ndarray]) -> Score:
        return Score(float(activate(raws[0].astype(np.float32), activation)[0]))

    return _plan_texts(texts, False, finish_one)


def _plan_bi_encoder(resolved: Resolved, model: ServedModel, limits: Limits) -> Plan:
    """Embed every text once, then the cosine similarity of each pair, in float32."""
    request = resolved.request
    firsts = _tokenize(resolved, model, limits, request.text_1, "score.text_1")
    seconds = _tokenize(resolved, model, limits, request.text_2, "score.text_2")
    vectors = _plan_texts(
        firsts + seconds, False, lambda text, raws: Embedding(_pooled_vector(text, raws))
    )

    def finish(raws: list[np.ndarray]) -> list[ItemOutput]:
        embedded = [e.values for e in vectors.finish(raws)]  # type: ignore[union-attr]
        first, second = embedded[: len(firsts)], embedded[len(firsts) :]
        return [Score(cosine(first[i], second[j])) for i, j in _pair_index(request)]

    return Plan(vectors.work, finish)


def _no_score_template(info: ModelInfo) -> PoolingError:
    violation = FieldViolation("model", info.score_refusal, "SCORE_TEMPLATE_MISSING")
    error = PoolingError.invalid([violation])
    error.kind = ErrorKind.FAILED_PRECONDITION
    return error


def _plan_llm_score(resolved: Resolved, model: ServedModel, limits: Limits) -> Plan:
    """Each pair read through the model's score template
    (engine/families/llm_reranker/score_template.py), the
    request's prompt as the template's {instruction}; the pair part is always truncated to
    what the request's truncation (else the maximum length) leaves beside the template.
    The runner returns logit(true) - logit(false), so the score is its sigmoid: the
    softmax over the two logits' true entry, as the model card computes it."""
    request, info = resolved.request, model.info
    template = info.score_template
    assert template is not None
    truncate = resolved.truncate
    max_tokens = info.max_input_tokens if truncate in (None, -1) else truncate
    pairs = [(request.text_1[i], request.text_2[j]) for i, j in _pair_index(request)]
    sequences = template.sequences(
        model.tokenizer, pairs, request.prompt, max_tokens, resolved.side
    )
    check_tokenized(resolved, limits, "score.text_2", [len(e) for e in sequences])
    texts = [_Text(e, [e]) for e in sequences]
    activation = Activation.SIGMOID if use_activation(request, True) else Activation.IDENTITY

    def finish_one(text: _Text, raws: list[np.ndarray]) -> Score:
        return Score(float(activate(raws[0].astype(np.float32), activation)[0]))

    return _plan_texts(texts, False, finish_one)


def _multi_vector_texts(
    resolved: Resolved,
    model: ServedModel,
    limits: Limits,
    texts: Sequence[str],
    query: bool,
    path: str,
) -> list[_Text]:
    """Texts in one mode, as PyLate / MultiVectorEncoder tokenize them: the mode's prefix;
    queries cut to query_length and filled up to it with mask tokens (expansion), documents
    cut to document_length (or the request's truncation, when shorter)."""
    settings = model.info.multi_vector
    assert settings is not None
    prompt = resolved.prompt
    if prompt is None or resolved.request.task is Task.SCORE:
        prompt = settings.query_prefix if query else settings.document_prefix
    length = settings.query_length if query else settings.document_length
    cut = resolved.truncate if resolved.truncate not in (None, -1) else None
    if query and settings.query_expansion and not settings.expansion_truncates:
        length = None  # "min" expansion: the query length is only a floor
    limit = min(n for n in (length, cut, model.info.max_input_tokens) if n is not None)
    sequences = model.tokenizer.tokenize(
        [prompt + t for t in texts], truncate=limit, side=resolved.side
    )
    check_tokenized(resolved, limits, path, [len(e) for e in sequences])
    if query and settings.query_expansion and settings.query_length:
        sequences = [_expand(e, settings) for e in sequences]
    return [_Text(e, [e]) for e in sequences]


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
    settings: MultiVectorSettings, text: _Text, rows: np.ndarray, query: bool
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
    settings = info.multi_vector
    named = request.prompt_name
    if named is None and request.prompt is None:
        named = info.default_prompt_name
    query = named == QUERY
    texts = _multi_vector_texts(resolved, model, limits, request.texts, query, "embed_multi.texts")

    def finish_one(text: _Text, raws: list[np.ndarray]) -> MultiVector:
        assert settings is not None
        values = _matrix(settings, text, raws[0], query)
        if request.encoding is OutputEncoding.FLOAT:
            return MultiVector(values)
        return MultiVector(values, request.encoding, encoded(request, info, values))

    return _plan_texts(texts, True, finish_one)


def _plan_maxsim(resolved: Resolved, model: ServedModel, limits: Limits) -> Plan:
    """score (and so Rerank) on a ColBERT model: text_1 as queries, text_2 as documents,
    each encoded once, then MaxSim per pair. Computed where the plan finishes, in numpy:
    the matrices are small (tens of rows) and already on the host for the response path,
    so a device round trip would cost more than the products."""
    request, settings = resolved.request, model.info.multi_vector
    assert settings is not None
    queries = _multi_vector_texts(resolved, model, limits, request.text_1, True, "score.text_1")
    documents = _multi_vector_texts(resolved, model, limits, request.text_2, False, "score.text_2")
    texts = queries + documents
    work = [(text.sequence, True) for text in texts]
    pairs = _pair_index(request)
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


# What each task asks of a multi-output (bge-m3) model; embed_outputs names its own.
_OUTPUT_OF_TASK = {
    Task.EMBED: Output.DENSE,
    Task.EMBED_SPARSE: Output.SPARSE,
    Task.EMBED_MULTI: Output.MULTI,
}


def _plan_multi_output(resolved: Resolved, model: ServedModel, limits: Limits) -> Plan:
    """embed, embed_sparse, embed_multi and embed_outputs on a bge-m3 model: each text's
    outputs sliced from its token rows (engine/families/bge_m3/multi_output.py's layout). Only the
    dense vector alone comes back pooled (one row); the others need every token's row."""
    request = resolved.request
    if request.task is Task.SCORE:
        return _plan_weighted_score(resolved, model, limits)
    assert request.task is not None
    task = request.task
    wanted = request.outputs if task is Task.EMBED_OUTPUTS else {_OUTPUT_OF_TASK[task]}
    texts = _tokenize(resolved, model, limits, request.texts, f"{task}.texts")
    keep_tokens = bool(set(wanted) - {Output.DENSE}) or any(t.pooling for t in texts)

    def finish_one(text: _Text, raws: list[np.ndarray]) -> ItemOutput:
        outputs = _text_outputs(request, model, text, raws, wanted)
        if task is Task.EMBED_OUTPUTS:
            return outputs
        found = {Output.DENSE: outputs.dense, Output.SPARSE: outputs.sparse}
        result = found.get(_OUTPUT_OF_TASK[task], outputs.multi)
        assert result is not None
        return result

    return _plan_texts(texts, keep_tokens, finish_one)


def _first_row(text: _Text, raws: list[np.ndarray]) -> np.ndarray:
    """The row the dense vector is read from: the pooled one, or the first token's (after
    the prompt, where include_prompt is false), from token rows."""
    if text.pooling is not None:
        return _pooled_vector(text, raws)
    return raws[0] if raws[0].ndim == 1 else raws[0][0]


def _text_outputs(
    request: PoolRequest,
    model: ServedModel,
    text: _Text,
    raws: list[np.ndarray],
    wanted: Set[Output],
) -> TextOutputs:
    info = model.info
    settings = info.multi_output
    assert settings is not None
    found: dict[str, object] = {}
    if Output.DENSE in wanted:
        values = dense(settings, _first_row(text, raws), use_activation(request, True))
        found["dense"] = (
            Embedding(values)
            if request.encoding is OutputEncoding.FLOAT
            else Embedding(values, request.encoding, encoded(request, info, values))
        )
    if Output.SPARSE in wanted:
        ids, weights = lexical(settings, text.sequence.input_ids, raws[0], request.sparse_top_k)
        tokens = model.tokenizer.tokens(ids.tolist()) if request.sparse_tokens else []
        found["sparse"] = SparseEmbedding(ids, weights, tokens)
    if Output.MULTI in wanted:
        matrix = colbert(settings, raws[0])
        found["multi"] = (
            MultiVector(matrix)
            if request.encoding is OutputEncoding.FLOAT
            else MultiVector(matrix, request.encoding, encoded(request, info, matrix))
        )
    return TextOutputs(**found)  # type: ignore[arg-type]


def _plan_weighted_score(resolved: Resolved, model: ServedModel, limits: Limits) -> Plan:
    """score (and so Rerank) on a bge-m3 model: the dense cosine alone, or with
    params.output_weights the weighted mean of the dense, lexical and ColBERT scores (as
    the model card's compute_score), each text encoded once with the outputs of positive
    weight."""
    request = resolved.request
    settings = model.info.multi_output
    assert settings is not None
    weights = request.params.output_weights
    needed = weighted_outputs(weights)
    firsts = _tokenize(resolved, model, limits, request.text_1, "score.text_1")
    seconds = _tokenize(resolved, model, limits, request.text_2, "score.text_2")
    texts = firsts + seconds
    keep_tokens = bool(set(needed) - {Output.DENSE}) or any(t.pooling for t in texts)
    work = [(part, keep_tokens) for text in texts for part in text.parts]

    def finish(raws: list[np.ndarray]) -> list[ItemOutput]:
        encoded = [
            _text_outputs(request, model, text, [raw], needed)
            for text, raw in zip(texts, raws, strict=True)
        ]
        first, second = encoded[: len(firsts)], encoded[len(firsts) :]
        scores = []
        for i, j in _pair_index(request):
            a, b = first[i], second[j]
            parts: dict[Output, float] = {}
            if a.dense is not None and b.dense is not None:
                parts[Output.DENSE] = cosine(a.dense.values, b.dense.values)
            if a.sparse is not None and b.sparse is not None:
                parts[Output.SPARSE] = lexical_score(
                    (a.sparse.indices, a.sparse.values), (b.sparse.indices, b.sparse.values)
                )
            if a.multi is not None and b.multi is not None:
                parts[Output.MULTI] = colbert_score(a.multi.values, b.multi.values)
            value = parts[Output.DENSE] if weights is None else combined(parts, weights)
            scores.append(Score(float(value)))
        return scores

    return Plan(work, finish)
