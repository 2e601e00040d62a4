"""The resolved request of engine/requests/validation.py, without a server: the prompt, the
long-input
policy and the truncation are decided once, by `resolve`, and every rule and the planner
read that one decision."""

from __future__ import annotations

from functools import partial

import pytest

from pooling_server.engine.errors import PoolingError
from pooling_server.engine.models.model_info import HeadKind, LongInput
from pooling_server.engine.requests.params import PoolingParams, Task
from pooling_server.engine.requests.request import PoolRequest, RerankRequest
from pooling_server.engine.requests.resolved import Limits, resolve
from pooling_server.engine.requests.size_rules import TOKENIZED_RULES, check_tokenized
from pooling_server.engine.requests.validation import (
    UNKNOWN_VALUES,
    unknown_value,
    validate_request,
    validate_rerank,
)
from tests.model_infos import embedder_info

MAX_TOKENS = 128


info = partial(
    embedder_info,
    max_input_tokens=MAX_TOKENS,
    prompts={"query": "query: "},
    default_prompt_name="query",
)


def request(task: Task = Task.EMBED, truncate: int | None = None, **fields: object) -> PoolRequest:
    params = PoolingParams(truncate_prompt_tokens=truncate)
    return PoolRequest(task=task, texts=("a",), params=params, **fields)  # type: ignore[arg-type]


CLASSIFIER = {"family": "cross_encoder", "head": HeadKind.SEQUENCE, "tasks": (Task.CLASSIFY,)}


@pytest.mark.parametrize(
    ("model", "made", "policy", "truncate", "cap"),
    [
        ({}, request(), LongInput.REJECT, None, MAX_TOKENS),
        ({}, request(truncate=16), LongInput.TRUNCATE, 16, 16),
        ({}, request(truncate=-1), LongInput.TRUNCATE, -1, MAX_TOKENS),
        ({"long_input": LongInput.TRUNCATE}, request(), LongInput.TRUNCATE, -1, MAX_TOKENS),
        ({"long_input": LongInput.CHUNK}, request(), LongInput.CHUNK, None, None),
        # The request's own truncation wins over the model's chunking.
        ({"long_input": LongInput.CHUNK}, request(truncate=16), LongInput.TRUNCATE, 16, 16),
        # A classifier has no per-token states or vector to average: it cannot chunk.
        (
            {"long_input": LongInput.CHUNK, **CLASSIFIER},
            request(Task.CLASSIFY),
            LongInput.REJECT,
            None,
            MAX_TOKENS,
        ),
    ],
)
def test_long_input_policy_is_decided_once(
    model: dict[str, object],
    made: PoolRequest,
    policy: LongInput,
    truncate: int | None,
    cap: int | None,
) -> None:
    resolved = validate_request(made, info(**model), Limits())
    assert (resolved.long_input, resolved.truncate, resolved.token_cap) == (policy, truncate, cap)
    assert resolved == resolve(made, info(**model))  # validation returns what resolve decides


def test_long_text_bound_follows_the_policy() -> None:
    """Truncated and chunked pooled outputs may run long; chunked token outputs may not."""
    chunk = info(long_input=LongInput.CHUNK)
    assert resolve(request(), chunk).may_run_long
    assert not resolve(request(Task.TOKEN_EMBED), chunk).may_run_long
    assert resolve(request(Task.TOKEN_EMBED, truncate=8), chunk).may_run_long
    assert not resolve(request(), info()).may_run_long


def test_prompt_and_side_are_resolved_for_the_planner() -> None:
    assert resolve(request(), info()).prompt == "query: "
    assert resolve(request(prompt=""), info()).prompt == ""
    assert resolve(request(Task.SCORE), info()).prompt is None  # score takes no prompt
    assert resolve(request(), info()).side == "right"
    assert resolve(request(truncation_side="left"), info()).side == "left"


def test_rerank_resolves_its_score_request() -> None:
    rerank = RerankRequest("q", ("a", "b"), top_n=1, truncation_side="left")
    resolved = validate_rerank(rerank, info(), Limits())
    assert resolved.rerank is rerank
    assert resolved.request.task is Task.SCORE and resolved.request.text_2 == ("a", "b")
    assert resolved.side == "left" and resolved.prompt is None


def test_tokenized_rules_refuse_as_the_policy_says() -> None:
    """The length rule runs from the table on token counts: a rejecting request is refused
    per input, a truncating or chunking one is not."""
    assert TOKENIZED_RULES
    counts = [MAX_TOKENS, MAX_TOKENS + 1]
    with pytest.raises(PoolingError) as caught:
        check_tokenized(resolve(request(), info()), Limits(), "embed.texts", counts)
    assert [(v.field, v.reason) for v in caught.value.violations] == [
        ("embed.texts[1]", "INPUT_TOO_LONG")
    ]
    chunk = info(long_input=LongInput.CHUNK)
    check_tokenized(resolve(request(), chunk), Limits(), "embed.texts", counts)
    check_tokenized(resolve(request(truncate=-1), info()), Limits(), "embed.texts", counts)


@pytest.mark.parametrize("path", sorted(UNKNOWN_VALUES))
def test_unknown_values_come_from_the_table(path: str) -> None:
    reason, _ = UNKNOWN_VALUES[path]
    error = unknown_value(path, 99)
    assert [(v.field, v.reason) for v in error.violations] == [(path, reason)]
    assert error.reason == reason
