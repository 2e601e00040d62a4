"""Plans on a bge-m3 model: embed, embed_sparse, embed_multi and embed_outputs sliced from
one pass's token rows (multi_output.py's layout), and score by the dense cosine or the
weighted outputs. Torch-free: front ends plan and finish with it."""

from __future__ import annotations

from collections.abc import Set

import numpy as np

from pooling_server.engine.families.bge_m3.multi_output import (
    MultiOutputSettings,
    colbert,
    colbert_score,
    combined,
    dense,
    lexical,
    lexical_score,
    weighted_outputs,
)
from pooling_server.engine.models.served import ServedModel
from pooling_server.engine.requests.heads import cosine
from pooling_server.engine.requests.outputs import (
    Embedding,
    ItemOutput,
    MultiVector,
    Score,
    SparseEmbedding,
    TextOutputs,
)
from pooling_server.engine.requests.params import Output, OutputEncoding, Task
from pooling_server.engine.requests.plan_parts import Plan, encoded, use_activation
from pooling_server.engine.requests.plans import (
    TextParts,
    pair_index,
    plan_texts,
    pooled_vector,
    tokenize_texts,
)
from pooling_server.engine.requests.request import PoolRequest
from pooling_server.engine.requests.resolved import Limits, Resolved

# What each task asks of the model; embed_outputs names its own.
_OUTPUT_OF_TASK = {
    Task.EMBED: Output.DENSE,
    Task.EMBED_SPARSE: Output.SPARSE,
    Task.EMBED_MULTI: Output.MULTI,
}


def plan(resolved: Resolved, model: ServedModel, limits: Limits) -> Plan:
    """Each text's outputs sliced from its token rows. Only the dense vector alone comes
    back pooled (one row); the others need every token's row."""
    request = resolved.request
    if request.task is Task.SCORE:
        return _plan_weighted_score(resolved, model, limits)
    assert request.task is not None
    task = request.task
    wanted = request.outputs if task is Task.EMBED_OUTPUTS else {_OUTPUT_OF_TASK[task]}
    texts = tokenize_texts(resolved, model, limits, request.texts, f"{task}.texts")
    keep_tokens = bool(set(wanted) - {Output.DENSE}) or any(t.pooling for t in texts)

    def finish_one(text: TextParts, raws: list[np.ndarray]) -> ItemOutput:
        outputs = _text_outputs(request, model, text, raws, wanted)
        if task is Task.EMBED_OUTPUTS:
            return outputs
        found = {Output.DENSE: outputs.dense, Output.SPARSE: outputs.sparse}
        result = found.get(_OUTPUT_OF_TASK[task], outputs.multi)
        assert result is not None
        return result

    return plan_texts(texts, keep_tokens, finish_one)


def _first_row(text: TextParts, raws: list[np.ndarray]) -> np.ndarray:
    """The row the dense vector is read from: the pooled one, or the first token's (after
    the prompt, where include_prompt is false), from token rows."""
    if text.pooling is not None:
        return pooled_vector(text, raws)
    return raws[0] if raws[0].ndim == 1 else raws[0][0]


def _text_outputs(
    request: PoolRequest,
    model: ServedModel,
    text: TextParts,
    raws: list[np.ndarray],
    wanted: Set[Output],
) -> TextOutputs:
    info = model.info
    settings = info.settings
    assert isinstance(settings, MultiOutputSettings)
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
    """score (and so Rerank): the dense cosine alone, or with params.output_weights the
    weighted mean of the dense, lexical and ColBERT scores (as the model card's
    compute_score), each text encoded once with the outputs of positive weight."""
    request = resolved.request
    weights = request.params.output_weights
    needed = weighted_outputs(weights)
    firsts = tokenize_texts(resolved, model, limits, request.text_1, "score.text_1")
    seconds = tokenize_texts(resolved, model, limits, request.text_2, "score.text_2")
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
        for i, j in pair_index(request):
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
