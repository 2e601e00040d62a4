"""The character bounds, counted before anything is tokenized: every text within its
model's limit and all of a request's within --max-request-chars, a prompt counted with
each text it precedes, score pairs as a model reads them (`pair_bounds`, for the families
that read a pair as one sequence), and Tokenize's texts (`validate_tokenize`)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from pooling_server.engine.errors import FieldViolation, PoolingError
from pooling_server.engine.models.model_info import ModelInfo
from pooling_server.engine.requests.output_size import ResponseBudget, fewest_tokens, tokenize_bytes
from pooling_server.engine.requests.params import Task
from pooling_server.engine.requests.request import Item, PoolRequest
from pooling_server.engine.requests.resolved import Limits, Resolved
from pooling_server.engine.requests.size_rules import output_too_large


def inputs_of(request: PoolRequest) -> Iterator[tuple[str, Sequence[str]]]:
    """Each input list with its field path (an image item counts as an empty text)."""
    if request.task is Task.SCORE:
        yield from _texts_of("score.text_1", request.text_1, "score.items_1", request.items_1)
        yield from _texts_of("score.text_2", request.text_2, "score.items_2", request.items_2)
    elif request.task is not None:
        task = request.task
        yield from _texts_of(f"{task}.texts", request.texts, f"{task}.items", request.items)


def _texts_of(
    path: str, texts: tuple[str, ...], items_path: str, items: tuple[Item, ...]
) -> Iterator[tuple[str, Sequence[str]]]:
    if items:
        yield items_path, [item if isinstance(item, str) else "" for item in items]
    else:
        yield path, texts


def characters(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
    """Bound every text, and all of them, by characters before anything is tokenized."""
    request, info = r.request, r.info
    if request.task is None or request.num_items > limits.max_client_batch_size:
        return  # the batch size rule speaks for a request this large
    lists = list(inputs_of(request))
    whole = "score" if request.task is Task.SCORE else lists[0][0]
    prompt = len(r.prompt or "")  # counted with every text it precedes
    limit = info.char_limit(r.may_run_long)
    if request.task is Task.SCORE and info.is_cross_encoder:
        return  # pairs read as one sequence: its family bounds them (pair_bounds)
    yield from character_bounds(lists, whole, limit, limits, prompt)


def pair_bounds(r: Resolved, limits: Limits, template: Any = None) -> Iterator[FieldViolation]:
    """For a model that reads each score pair as one sequence (a cross-encoder; an LLM
    reranker, through its `template`: a ScoreTemplate): every text within the model's
    limit, an instruction too; and the pairs as they are built (each text_1 with each of
    its text_2, in the template with the instruction) within the request bound: what a
    request multiplies counts as often as it is read, before any pair's text is built."""
    request, info = r.request, r.info
    if request.task is not Task.SCORE or request.num_items > limits.max_client_batch_size:
        return  # the batch size rule speaks for a request this large
    lists = list(inputs_of(request))
    limit = info.char_limit(r.may_run_long)
    instruction = request.prompt
    unbounded = Limits(max_request_chars=1 << 62)  # the pairs' total is counted below
    yield from character_bounds(lists, "score", limit, unbounded)
    if template is not None and instruction is not None and len(instruction) > limit:
        yield FieldViolation(
            "prompt",
            f"has {len(instruction)} characters, more than this model's limit of {limit} "
            "(--max-input-chars); shorten it",
            "INPUT_TOO_LONG",
        )
    firsts, seconds = (texts for _, texts in lists)
    one = len(firsts) == 1
    if not seconds or not (one or len(firsts) == len(seconds)):
        return  # the shape rules speak for it
    if template is None:
        total = sum(map(len, seconds)) + (
            len(seconds) * len(firsts[0]) if one else sum(map(len, firsts))
        )
        read_with = "its query"
    else:
        told = len(template.default_instruction if instruction is None else instruction)
        total = sum(
            template.pair_chars(len(firsts[0 if one else j]), len(d), told)
            for j, d in enumerate(seconds)
        )
        read_with = "its query, the instruction and the template"
    if total > limits.max_request_chars:
        yield FieldViolation(
            "score",
            f"the pairs hold {total} characters together (each document read with "
            f"{read_with}), more than the limit of {limits.max_request_chars} per request "
            "(--max-request-chars); split the request",
            "REQUEST_TOO_LARGE",
        )


def character_bounds(
    lists: Sequence[tuple[str, Sequence[str]]],
    whole: str,
    limit: int,
    limits: Limits,
    prompt: int = 0,
) -> Iterator[FieldViolation]:
    """Each text (with `prompt` characters before it) within `limit` characters (path
    `list[i]`), and all of them within the request bound (path `whole`)."""
    with_prompt = " with its prompt" if prompt else ""
    for path, texts in lists:
        for i, text in enumerate(texts):
            if len(text) + prompt > limit:
                yield FieldViolation(
                    f"{path}[{i}]",
                    f"has {len(text) + prompt} characters{with_prompt}, more than this model's "
                    f"limit of {limit} (--max-input-chars); shorten it",
                    "INPUT_TOO_LONG",
                )
    total = sum(len(text) + prompt for _, texts in lists for text in texts)
    if total > limits.max_request_chars:
        yield FieldViolation(
            whole,
            f"the texts hold {total} characters together, more than the limit of "
            f"{limits.max_request_chars} per request (--max-request-chars); split the request",
            "REQUEST_TOO_LARGE",
        )


def validate_tokenize(
    texts: Sequence[str], info: ModelInfo, limits: Limits, budget: ResponseBudget | None = None
) -> None:
    """Tokenize's bounds: as many texts as a request, each up to the long-text character
    limit (Tokenize counts tokens of texts that may be truncated or chunked later). No
    text at all is EMPTY_INPUT, as for every other request."""
    if not texts:
        raise PoolingError.invalid(
            [FieldViolation("texts", "must hold at least one text", "EMPTY_INPUT")]
        )
    if len(texts) > limits.max_client_batch_size:
        raise PoolingError.invalid(
            [
                FieldViolation(
                    "texts",
                    f"{len(texts)} texts exceed the limit of {limits.max_client_batch_size} "
                    "per request (--max-client-batch-size)",
                    "TOO_MANY_INPUTS",
                )
            ]
        )
    violations = list(
        character_bounds([("texts", texts)], "texts", info.char_limit(long=True), limits)
    )
    if violations:
        raise PoolingError.invalid(violations)
    # Tokenizing is the work here, so the answer is bounded before it: at least one token
    # per word. Texts that fit even at one token per character need no counting.
    specials, budget = info.num_special_tokens, budget or limits.response
    most = [(len(text) + specials, len(text)) for text in texts]
    if tokenize_bytes(most, budget) <= budget.max_bytes:
        return
    floor = fewest_tokens(texts, specials, None)
    estimate = tokenize_bytes(zip(floor, map(len, texts), strict=True), budget)
    if estimate > budget.max_bytes:
        raise output_too_large("texts", estimate, budget)
