"""The prompt rules: prompt_name or prompt (not both), only on the tasks that take one
(or an LLM reranker's instruction on score), and a prompt_name the model has."""

from __future__ import annotations

from collections.abc import Iterator

from pooling_server.engine.errors import FieldViolation, PoolingError, clip
from pooling_server.engine.families import family
from pooling_server.engine.models.model_info import ModelInfo
from pooling_server.engine.requests.params import PROMPT_TASKS, Task
from pooling_server.engine.requests.resolved import Limits, Resolved


def prompt_conflict(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
    request = r.request
    if request.prompt is not None and request.prompt_name is not None:
        yield FieldViolation(
            "prompt",
            "set prompt_name (one of the model's prompts) or prompt (a text), not both",
            "PROMPT_CONFLICT",
        )


def prompt_for_task(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
    request = r.request
    if request.task in PROMPT_TASKS:
        return
    takes = ", ".join(task.value for task in Task if task in PROMPT_TASKS)
    for name in ("prompt_name", "prompt"):
        if name == "prompt" and family(r.info.family).instruction:
            continue  # an LLM reranker's instruction (its template's {instruction})
        if getattr(request, name) is None:
            continue
        description = f"prompts apply to {takes}; {request.task} takes none: leave {name} unset"
        if name == "prompt" and request.task is Task.SCORE:  # Rerank's instruction
            description = (
                f"an instruction applies only to an LLM reranker (a model with a score "
                f'template); model "{r.info.name}" has none: leave it unset'
            )
        yield FieldViolation(name, description, "PROMPT_NOT_SUPPORTED_FOR_TASK")


def prompt_name(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
    request, info = r.request, r.info
    name = request.prompt_name
    if name is None or request.task not in PROMPT_TASKS or name in info.prompts:
        return
    yield _unknown_prompt(name, info)


def _unknown_prompt(name: str, info: ModelInfo) -> FieldViolation:
    if info.prompts:
        known = "its prompts: " + ", ".join(f'"{clip(p)}"' for p in info.prompts)
    else:
        known = "it has none (they come from config_sentence_transformers.json)"
    return FieldViolation(
        "prompt_name",
        f'model "{info.name}" has no prompt named "{clip(name)}"; {known}',
        "PROMPT_NAME_UNKNOWN",
    )


def named_prompt(name: str, info: ModelInfo) -> str:
    """The model's prompt of that name (TEI's /tokenize prompt_name), or its refusal."""
    prompt = info.prompts.get(name)
    if prompt is None:
        raise PoolingError.invalid([_unknown_prompt(name, info)])
    return prompt
