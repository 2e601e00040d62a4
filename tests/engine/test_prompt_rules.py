"""The prompt rules (engine/requests/prompt_rules.py), run through the table without a
server: reasons, field paths, bounds."""

from __future__ import annotations

from functools import partial

import pytest

from pooling_server.engine.errors import ErrorKind, PoolingError
from pooling_server.engine.models.model_info import HeadKind, LongInput, ModelInfo
from pooling_server.engine.requests.params import PoolingParams, Task
from pooling_server.engine.requests.request import PoolRequest
from pooling_server.engine.requests.resolved import Limits, prompt_text
from pooling_server.engine.requests.validation import validate_request
from tests.model_infos import embedder_info

PROMPTS = {"query": "query: ", "passage": "passage: "}


info = partial(embedder_info, prompts=PROMPTS, default_prompt_name="query")


def embed(*texts: str, **fields: object) -> PoolRequest:
    return PoolRequest(task=Task.EMBED, texts=texts, **fields)  # type: ignore[arg-type]


def refused(
    request: PoolRequest, model: ModelInfo | None = None, limits: Limits | None = None
) -> PoolingError:
    with pytest.raises(PoolingError) as caught:
        validate_request(request, model or info(), limits or Limits())
    return caught.value


def test_prompt_resolution_follows_sentence_transformers() -> None:
    model = info()
    assert prompt_text(embed("a"), model) == "query: "  # the default
    assert prompt_text(embed("a", prompt_name="passage"), model) == "passage: "
    assert prompt_text(embed("a", prompt="x: "), model) == "x: "
    assert prompt_text(embed("a", prompt=""), model) == ""  # opts out of the default
    assert prompt_text(embed("a"), info(default_prompt_name=None)) is None
    score = PoolRequest(task=Task.SCORE, text_1=("q",), text_2=("d",))
    assert prompt_text(score, model) is None  # no prompts on score, not even the default


def test_conflict() -> None:
    error = refused(embed("a", prompt_name="query", prompt="q: "))
    assert (error.kind, error.reason) == (ErrorKind.INVALID_ARGUMENT, "PROMPT_CONFLICT")
    assert [v.field for v in error.violations] == ["prompt"]


def test_unknown_name_lists_the_prompts() -> None:
    error = refused(embed("a", prompt_name="nope"))
    assert (error.kind, error.reason) == (ErrorKind.INVALID_ARGUMENT, "PROMPT_NAME_UNKNOWN")
    (violation,) = error.violations
    assert violation.field == "prompt_name"
    assert '"query"' in violation.description and '"passage"' in violation.description


def test_unknown_name_on_a_model_without_prompts() -> None:
    error = refused(embed("a", prompt_name="query"), info(prompts={}, default_prompt_name=None))
    assert error.reason == "PROMPT_NAME_UNKNOWN"
    assert "has none" in error.violations[0].description


def test_prompt_on_a_task_without_prompts() -> None:
    score = PoolRequest(task=Task.SCORE, text_1=("q",), text_2=("d",), prompt_name="query")
    error = refused(score)
    assert (error.reason, [v.field for v in error.violations]) == (
        "PROMPT_NOT_SUPPORTED_FOR_TASK",
        ["prompt_name"],
    )


def test_character_bound_counts_the_prompt() -> None:
    model = info(max_input_chars=40, default_prompt_name=None)
    fits = "x" * (40 - len("query: "))
    validate_request(embed(fits + "x"), model, Limits())  # no prompt: 40 characters
    validate_request(embed(fits, prompt_name="query"), model, Limits())
    error = refused(embed("a", fits + "x", prompt="query: "), model)
    assert error.reason == "INPUT_TOO_LONG"
    (violation,) = error.violations
    assert violation.field == "embed.texts[1]"
    assert "with its prompt" in violation.description
    # The request bound counts the prompt once per text.
    limits = Limits(max_request_chars=2 * len(fits) + 1)
    validate_request(embed(fits, fits), model, limits)
    error = refused(embed(fits, fits, prompt_name="query"), model, limits)
    assert error.reason == "REQUEST_TOO_LARGE"


def test_truncate_takes_the_long_character_bound() -> None:
    text = "x" * (64 * 128 + 1)
    assert refused(embed(text), info(default_prompt_name=None)).reason == "INPUT_TOO_LONG"
    validate_request(embed(text), info(long_input=LongInput.TRUNCATE), Limits())
    classify = PoolRequest(task=Task.CLASSIFY, texts=(text,))
    classifier = info(
        family="cross_encoder",
        head=HeadKind.SEQUENCE,
        tasks=(Task.CLASSIFY,),
        long_input=LongInput.TRUNCATE,
    )
    validate_request(classify, classifier, Limits())
    # Still bounded: 1024 characters per token.
    too_long = embed("x" * (1024 * 128 + 1), params=PoolingParams())
    assert refused(too_long, info(long_input=LongInput.TRUNCATE)).reason == "INPUT_TOO_LONG"
