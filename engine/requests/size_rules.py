"""The rules on an answer's size: what the request alone says of it, before tokenizing
(`answer_size`, a row of validation.py's RULES), and what the token counts say once
tokenized (TOKENIZED_RULES: lengths and rows per token), each refused before the work."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

from pooling_server.engine.errors import ErrorKind, FieldViolation, PoolingError
from pooling_server.engine.families import family
from pooling_server.engine.models.model_info import LongInput, ModelInfo
from pooling_server.engine.requests.output_size import (
    ResponseBudget,
    fewest_tokens,
    late_chunk_count,
    megabytes,
    pooled_bytes,
    token_rows_bytes,
    tokenize_bytes,
    word_count,
)
from pooling_server.engine.requests.params import Task
from pooling_server.engine.requests.request import ChunkRule, PoolRequest
from pooling_server.engine.requests.resolved import (
    TOKEN_TASKS,
    Limits,
    Resolved,
    list_path,
    resolve,
)


def response_budget(request: PoolRequest, limits: Limits) -> ResponseBudget:
    return request.response_budget or limits.response


def output_violation(path: str, estimate: int, budget: ResponseBudget) -> FieldViolation:
    """An answer over the door's limit: refused before the work that would make it."""
    return FieldViolation(
        path,
        f"the answer would hold about {megabytes(estimate)} ({estimate} bytes), more than "
        f"the limit of {megabytes(budget.max_bytes)} ({budget.max_bytes} bytes, "
        f"{budget.setting}); send fewer or shorter inputs per request",
        "OUTPUT_TOO_LARGE",
    )


def output_too_large(path: str, estimate: int, budget: ResponseBudget) -> PoolingError:
    """`path`: the inputs at fault; empty where the answer as a whole is (its real size)."""
    violation = output_violation(path, estimate, budget)
    if path:
        error = PoolingError.invalid([violation])
    else:
        error = PoolingError(ErrorKind.INVALID_ARGUMENT, violation.reason, violation.description)
    error.metadata = {"estimated_bytes": str(estimate), "limit_bytes": str(budget.max_bytes)}
    return error


def answer_size(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
    """What the request alone says of its answer's size: one vector, class row or score per
    input; late chunks counted on the texts; for outputs of a row per token (token
    outputs, a family's own: Family.rows), at least a row per word of every text
    (counted exactly once tokenized: _token_output), so that the tokenizer never runs for
    a refusal."""
    request, info = r.request, r.info
    assert request.task is not None
    budget, dims = response_budget(request, limits), request.params.dimensions
    if dims is not None and not 1 <= dims <= info.hidden_size:
        return  # _dimensions speaks for it
    if request.late_chunking is not None and request.task is Task.EMBED:
        estimate = _late_chunks_estimate(r, budget)
    elif request.task in ROW_TASKS:
        cap = _rows_cap(r)
        specials = info.num_special_tokens
        most = [len(text) + specials for text in request.texts]
        if cap is not None:
            most = [min(n, cap) for n in most]
        if rows_bytes(r, most, budget) <= budget.max_bytes:
            return  # fits even at one token per character: no words to count
        estimate = rows_bytes(r, fewest_tokens(request.texts, specials, cap), budget)
    else:
        if request.candidate_labels:  # zero-shot: one value per candidate label
            info = replace(info, labels=request.candidate_labels)
        estimate = pooled_bytes(
            request.task, request.num_items, info, dims, request.encoding, budget
        )
    if estimate > budget.max_bytes:
        yield output_violation(list_path(request), estimate, budget)


def _rows_cap(r: Resolved) -> int | None:
    """The most tokens a text of a ROW_TASKS request keeps: as its family cuts it
    (Family.rows), else its truncation or the maximum length."""
    rows = family(r.info.family).rows
    if r.request.task in TOKEN_TASKS or rows is None or rows.cap is None:
        return r.token_cap
    return rows.cap(r)


# The tasks whose answers hold rows per token, sized from each text's tokens (rows_bytes).
ROW_TASKS = TOKEN_TASKS | {Task.EMBED_MULTI, Task.EMBED_OUTPUTS}


def rows_bytes(r: Resolved, tokens: Sequence[int], budget: ResponseBudget) -> int:
    """The answer of a ROW_TASKS request whose texts have `tokens` tokens each (as
    tokenized, truncation applied): token outputs a row per token; the other tasks as
    the model's family sizes them (Family.rows; 0 where it has none: the task is
    refused)."""
    request, info = r.request, r.info
    task, encoding, dims = request.task, request.encoding, request.params.dimensions
    assert task is not None
    if task in TOKEN_TASKS:
        return token_rows_bytes(task, tokens, info, dims, encoding, budget)
    rows = family(info.family).rows
    return 0 if rows is None else rows.answer(r, tokens, budget)


def _late_chunks_estimate(r: Resolved, budget: ResponseBudget) -> int:
    """Late chunks' vectors, counted before tokenizing: spans as given, sentences on the
    texts (counting stops once past what the budget holds), the tokens rule at one token
    per word at least."""
    from pooling_server.engine.requests.late_chunking import (
        sentence_count,  # it imports this module
    )

    request, info = r.request, r.info
    chunking = request.late_chunking
    assert chunking is not None
    one = pooled_bytes(Task.EMBED, 1, info, request.params.dimensions, request.encoding, budget)
    most = budget.max_bytes // max(one, 1) + 1  # chunks past this are refused alike
    if chunking.spans:
        chunks = len(chunking.spans)
    elif chunking.rule is ChunkRule.SENTENCES:
        chunks = 0
        for text in request.texts:
            chunks += sentence_count(text, most - chunks)
            if chunks >= most:
                break
    elif chunking.rule is ChunkRule.TOKENS and chunking.window >= 1:
        chunks, stride = 0, chunking.window - chunking.overlap
        for text in request.texts:  # words past those `most` chunks need are not counted
            words = word_count(text, chunking.window + (most - chunks) * stride)
            chunks += late_chunk_count(words, chunking.window, chunking.overlap)
            if chunks >= most:
                break
    else:
        return 0  # _late_chunking speaks for it
    return chunks * one


# Rules that need token counts: run once tokenized (on a tokenizer thread), before the
# forward pass, for each list of inputs. `path` names the list, `counts` holds each
# input's tokens as tokenized (truncation applied, before chunking).

TokenizedCheck = Callable[[Resolved, Limits, str, Sequence[int]], PoolingError | None]


def _lengths(r: Resolved, limits: Limits, path: str, counts: Sequence[int]) -> PoolingError | None:
    """Inputs over the model's maximum length, where the request neither truncates nor
    chunks them; or over the request's own max_tokens, where it sets one."""
    own, limit = r.request.max_tokens, r.info.max_input_tokens
    if own is None and r.long_input is not LongInput.REJECT:
        return None
    bound = "the model's maximum"
    if own is not None and own < limit:
        limit, bound = max(own, r.info.num_special_tokens), "the request's max_tokens"
    if max(counts, default=0) <= limit:
        return None
    return PoolingError.invalid(
        [
            FieldViolation(
                f"{path}[{i}]",
                f"has {count} tokens, more than {bound} of {limit}; "
                "shorten it or set params.truncate_prompt_tokens (-1 truncates to the maximum)",
                "INPUT_TOO_LONG",
            )
            for i, count in enumerate(counts)
            if count > limit
        ]
    )


def _token_output(
    r: Resolved, limits: Limits, path: str, counts: Sequence[int]
) -> PoolingError | None:
    """Outputs of rows per token (ROW_TASKS): each text's rows counted on its tokens (its
    chunks joined back), before the forward pass."""
    request = r.request
    task = request.task
    if task not in ROW_TASKS:
        return None
    budget = response_budget(request, limits)
    estimate = rows_bytes(r, counts, budget)
    if estimate <= budget.max_bytes:
        return None
    return output_too_large(f"{task}.texts", estimate, budget)


TOKENIZED_RULES: tuple[TokenizedCheck, ...] = (_lengths, _token_output)


def check_token_output(
    request: PoolRequest, info: ModelInfo, limits: Limits, rows: Sequence[int]
) -> None:
    """The token-output rule alone, for a request not yet resolved: `rows` tokens per text."""
    error = _token_output(resolve(request, info), limits, f"{request.task}.texts", rows)
    if error is not None:
        raise error


def check_tokenized(r: Resolved, limits: Limits, path: str, counts: Sequence[int]) -> None:
    """Raise the first error of TOKENIZED_RULES for one tokenized list of inputs."""
    for check in TOKENIZED_RULES:
        error = check(r, limits, path, counts)
        if error is not None:
            raise error


def check_tokenize_output(
    tokens_and_lengths: Sequence[tuple[int, int]],
    limits: Limits,
    budget: ResponseBudget | None = None,
) -> None:
    """Once tokenized, before the ids become token strings and messages; `budget`: the
    answering door's (gRPC's by default)."""
    budget = budget or limits.response
    estimate = tokenize_bytes(tokens_and_lengths, budget)
    if estimate > budget.max_bytes:
        raise output_too_large("texts", estimate, budget)
