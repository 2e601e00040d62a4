"""Per task: which sequences a request needs computed, and how raw outputs become results.

Pooling methods ran in the model runner; here the heads (matryoshka truncation,
normalisation, activations) and chunk merging are applied per item, so one batch
can mix requests with different parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from pooling_server.engine.errors import ErrorKind, FieldViolation, PoolingError
from pooling_server.engine.families import family_of
from pooling_server.engine.inputs.tokenization import TokenSequence, special_edges
from pooling_server.engine.models.model_info import (
    Activation,
    ModelInfo,
    PoolingType,
)
from pooling_server.engine.models.served import ServedModel
from pooling_server.engine.requests.heads import (
    activate,
)
from pooling_server.engine.requests.outputs import (
    ItemOutput,
    TokenRows,
)
from pooling_server.engine.requests.params import Task
from pooling_server.engine.requests.plan_parts import Plan, use_activation
from pooling_server.engine.requests.request import PoolRequest
from pooling_server.engine.requests.resolved import Limits, Resolved, resolve
from pooling_server.engine.requests.size_rules import check_tokenized


@dataclass(frozen=True)
class TextParts:
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


def plan_text(resolved: Resolved, model: ServedModel, limits: Limits) -> Plan:
    """A task the model's family has no plan for: validation refuses it first; this
    refuses a request planned unchecked."""
    raise _unsupported(resolved.request.task, model.info)


def _unsupported(task: Task | None, info: ModelInfo) -> PoolingError:
    supported = ", ".join(t.value for t in info.tasks)
    violation = FieldViolation(
        str(task),
        f'model "{info.name}" does not support {task}; it supports: {supported}',
        "TASK_NOT_SUPPORTED",
    )
    error = PoolingError.invalid([violation])
    error.kind = ErrorKind.FAILED_PRECONDITION
    return error


def plan_per_text(
    resolved: Resolved,
    model: ServedModel,
    limits: Limits,
    finish_one: Callable[[PoolRequest, ModelInfo, TextParts, list[np.ndarray]], ItemOutput],
    keep_tokens: bool = False,
) -> Plan:
    """One output per text of the request, each finished from its parts' raw outputs.
    `keep_tokens`: the runner returns every token's row (else the pooled vector; also
    token rows where the prompt is left out of the pooling, pooled here)."""
    request = resolved.request
    texts = tokenize_texts(resolved, model, limits, request.texts, f"{request.task}.texts")
    keep_tokens = keep_tokens or any(text.pooling is not None for text in texts)
    return plan_texts(
        texts, keep_tokens, lambda text, raws: finish_one(request, model.info, text, raws)
    )


def plan_texts(
    texts: list[TextParts],
    keep_tokens: bool,
    finish_one: Callable[[TextParts, list[np.ndarray]], ItemOutput],
) -> Plan:
    work = [(part, keep_tokens) for text in texts for part in text.parts]

    def finish(raws: list[np.ndarray]) -> list[ItemOutput]:
        outputs, start = [], 0
        for text in texts:
            outputs.append(finish_one(text, raws[start : start + len(text.parts)]))
            start += len(text.parts)
        return outputs

    return Plan(work, finish)


def tokenize_texts(
    resolved: Resolved,
    model: ServedModel,
    limits: Limits,
    texts: Sequence[str],
    path: str,
    pairs: Sequence[str] | None = None,
) -> list[TextParts]:
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
    chunk = model.tokenizer.chunk
    return [
        TextParts(e, chunk(e) if len(e) > info.max_input_tokens else [e], pooling, skip)
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


def pooled_vector(text: TextParts, raws: list[np.ndarray]) -> np.ndarray:
    """One chunk: its vector. Several: their token-weighted mean (vLLM's chunked processing)."""
    if text.pooling is not None:  # token states: pool them here, the prompt left out
        raws = [
            _pool_rows(raw, text.skip if i == 0 else 0, text.pooling) for i, raw in enumerate(raws)
        ]
    if len(raws) == 1:
        return raws[0]
    weights = np.array([len(part) for part in text.parts], dtype=np.float32)
    return (np.stack(raws) * weights[:, None]).sum(axis=0) / weights.sum()


def token_rows(text: TextParts, raws: list[np.ndarray]) -> np.ndarray:
    """Chunks' rows joined back into one row per token of the full text."""
    if len(raws) == 1:
        return raws[0]
    prefix, suffix = special_edges(text.sequence.special_mask)
    rows = [raws[0][:prefix]]
    rows += [raw[prefix : len(raw) - suffix] for raw in raws]
    rows.append(raws[-1][len(raws[-1]) - suffix :])
    return np.concatenate(rows)


def class_values(request: PoolRequest, info: ModelInfo, logits: np.ndarray) -> np.ndarray:
    activation = info.activation if use_activation(request, True) else Activation.IDENTITY
    return activate(logits.astype(np.float32), activation)


def rows_output(
    text: TextParts,
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


def pair_index(request: PoolRequest) -> list[tuple[int, int]]:
    """(text_1 index, text_2 index) per pair: 1:N broadcasts the single text_1."""
    one = len(request.text_1) == 1
    return [(0 if one else i, i) for i in range(len(request.text_2))]
