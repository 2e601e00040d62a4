"""Every request rule, in one table. Nothing invalid reaches a model.

Rules run in stages: the shape of the input, then whether the model can run the
task, then the parameters. A stage with violations stops validation, so later
rules can rely on what earlier ones checked. Field paths follow the wire schema
(`embed.texts[3]`, `params.dimensions`) because the input case is named by the task.

Validation returns the request `Resolved` on its model (resolved.py): the prompt text, the
long-input policy (reject, truncate or chunk), the truncation and its side, decided once by
`resolve` and read as they are by the rules, the planner and the engine. The table is
here; its rows are in the modules named for what they check (shape_rules, character_rules,
item_rules, label_rules, prompt_rules, param_rules, late_chunking_rules, size_rules), and
a family's own rows join their stages. Two more
tables: TOKENIZED_RULES (token counts, on a tokenizer thread: size_rules.py) and
UNKNOWN_VALUES (enum values a door cannot map, as it decodes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from pooling_server.engine.errors import ErrorKind, FieldViolation, PoolingError, clip
from pooling_server.engine.families import ORDER, family
from pooling_server.engine.models.model_info import ModelInfo
from pooling_server.engine.requests.character_rules import characters
from pooling_server.engine.requests.item_rules import items_shape, modalities
from pooling_server.engine.requests.label_rules import (
    candidate_labels,
    label_total,
    zero_shot_model,
)
from pooling_server.engine.requests.late_chunking_rules import chunking_pooling, chunking_shape
from pooling_server.engine.requests.param_rules import (
    calibration,
    dimensions,
    encoding,
    params_for_task,
    sparse_top_k,
    truncate,
)
from pooling_server.engine.requests.params import Task
from pooling_server.engine.requests.prompt_rules import (
    prompt_conflict,
    prompt_for_task,
    prompt_name,
)
from pooling_server.engine.requests.request import PoolRequest, RerankRequest
from pooling_server.engine.requests.resolved import Check, Limits, Resolved, resolve
from pooling_server.engine.requests.shape_rules import (
    batch_size,
    input_not_empty,
    input_present,
    request_id,
    score_shape,
    task_agrees,
)
from pooling_server.engine.requests.size_rules import answer_size


def _task_hint(task: Task, info: ModelInfo) -> str:
    """Why a model lacks a task, where the answer is a family (Family.task_hint)."""
    for name in ORDER:
        hint = family(name).task_hint
        said = hint(task, info) if hint is not None else ""
        if said:
            return said
    return ""


def _task_supported(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
    request, info = r.request, r.info
    refuse = family(info.family).task_refusal
    refusal = refuse(request.task, info) if refuse and request.task is not None else None
    if refusal is not None:  # the family's own reason (a decoder LM without a template)
        yield refusal
        return
    if request.task is not None and request.task not in info.tasks:
        supported = ", ".join(task.value for task in info.tasks)
        yield FieldViolation(
            str(request.task),
            f'model "{info.name}" does not support {request.task}; it supports: {supported}'
            + _task_hint(request.task, info),
            "TASK_NOT_SUPPORTED",
        )


def _modalities_then_zero_shot(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
    """Items of a modality the model takes, then (with none refused) zero-shot labels only
    on a model that classifies zero-shot: one refusal of what the model cannot read, not
    two."""
    refused = False
    for violation in modalities(r, limits):
        refused = True
        yield violation
    if not refused:
        yield from zero_shot_model(r, limits)


@dataclass(frozen=True)
class Stage:
    kind: ErrorKind
    checks: tuple[Callable[..., Iterator[FieldViolation]], ...]  # Check, or RerankCheck
    # Which of a family's rules (FamilyRules' field) run in this stage, after its own.
    joins: str = ""
    # The family's rules of this stage renamed as RerankRequest names its fields.
    rerank: bool = False


RULES: tuple[Stage, ...] = (
    Stage(
        ErrorKind.INVALID_ARGUMENT,
        (
            input_present,
            input_not_empty,
            score_shape,
            batch_size,
            task_agrees,
            request_id,
            prompt_conflict,
            characters,
            label_total,
            sparse_top_k,
            chunking_shape,
            items_shape,
            candidate_labels,
        ),
        joins="shape",
    ),
    Stage(
        ErrorKind.FAILED_PRECONDITION,
        (_task_supported, chunking_pooling, _modalities_then_zero_shot),
        joins="model",
    ),
    Stage(
        ErrorKind.INVALID_ARGUMENT,
        (
            params_for_task,
            dimensions,
            truncate,
            encoding,
            prompt_for_task,
            prompt_name,
            answer_size,
        ),
        joins="params",
    ),
    Stage(ErrorKind.FAILED_PRECONDITION, (calibration,)),
)


def validate_request(
    request: PoolRequest,
    info: ModelInfo,
    limits: Limits,
    rules: tuple[Stage, ...] = RULES,
) -> Resolved:
    """The request resolved on `info`, for the planner; raise PoolingError for the first
    stage of `rules` that finds violations."""
    return _validate(resolve(request, info), limits, rules)


def _validate(resolved: Resolved, limits: Limits, rules: tuple[Stage, ...]) -> Resolved:
    for stage in _with_family(rules, resolved.info.family):
        violations = [v for check in stage.checks for v in check(resolved, limits)]
        if violations:
            # Raised as built, never held in a local: the traceback keeps this frame (and
            # the request in it), and a frame that held its own error would make a cycle
            # only the garbage collector frees.
            raise _stage_error(stage.kind, violations)
    return resolved


# (id of a table, family) -> (the table, it with the family's rules joined): looked up by id
# since hashing a table of functions would cost every request microseconds; the table is
# held so that its id stays its own.
_JOINED: dict[tuple[int, str], tuple[tuple[Stage, ...], tuple[Stage, ...]]] = {}


def _with_family(rules: tuple[Stage, ...], name: str) -> tuple[Stage, ...]:
    found = _JOINED.get((id(rules), name))
    if found is None or found[0] is not rules:
        found = _JOINED[id(rules), name] = (rules, _joined(rules, name))
    return found[1]


def _joined(rules: tuple[Stage, ...], name: str) -> tuple[Stage, ...]:
    """`rules` with the family's own rules joined to the stages they run in, and with its
    model rules those the other families run elsewhere (FamilyRules.elsewhere)."""
    own = family(name).rules
    others = tuple(c for n in ORDER if n != name for c in family(n).rules.elsewhere)
    joined = []
    for stage in rules:
        extra: tuple[Check, ...] = getattr(own, stage.joins) if stage.joins else ()
        if stage.joins == "model":
            extra += others
        if stage.rerank:
            extra = tuple(map(_for_rerank, extra))
        joined.append(replace(stage, checks=stage.checks + extra))
    return tuple(joined)


def _stage_error(kind: ErrorKind, violations: list[FieldViolation]) -> PoolingError:
    error = PoolingError.invalid(violations)
    error.kind = kind
    return error


# Rerank is a 1:N score request (the query against every document), so it runs every
# rule of RULES on that request, with the paths renamed as RerankRequest names its fields,
# plus its own rule for top_n.

RerankCheck = Check  # on the score request, its `rerank` set


def rerank_violation(violation: FieldViolation) -> FieldViolation:
    """A violation of the score request that computes a rerank, as RerankRequest names it:
    `score.text_1[0]` is `query`, `score.text_2[i]` is `documents[i]`, and the model is
    what lacks a task it does not support."""
    path, description = violation.field, violation.description
    head, bracket, rest = path.partition("[")
    if violation.reason == "TASK_NOT_SUPPORTED":
        path, description = "model", f"rerank needs the score task; {description}"
    elif head in ("score.text_1", "score.items_1"):
        path = "query"
    elif head in ("score.text_2", "score"):  # "score": all the texts together
        path = f"documents{bracket}{rest}"
    elif head == "score.items_2":  # image documents: Rerank's items
        path = f"items{bracket}{rest}"
    elif path == "prompt":  # an LLM reranker's instruction, as Rerank names it
        path = "instruction"
    return FieldViolation(path, description, violation.reason)


def rerank_error(error: PoolingError) -> PoolingError:
    """`error` of the score request that computes a rerank, with its paths renamed."""
    if not error.violations:
        return error
    renamed = PoolingError.invalid([rerank_violation(v) for v in error.violations])
    renamed.kind, renamed.metadata = error.kind, error.metadata
    return renamed


def _for_rerank(check: Check) -> RerankCheck:
    def run(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
        return (rerank_violation(v) for v in check(r, limits))

    return run


def _top_n(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
    assert r.rerank is not None
    top_n = r.rerank.top_n
    if top_n < 0:
        yield FieldViolation(
            "top_n",
            f"top_n must be 0 (every document) or a positive count, got {top_n}",
            "TOP_N_INVALID",
        )


RERANK_RULES: tuple[Stage, ...] = tuple(
    Stage(
        stage.kind,
        ((_top_n,) if k == 0 else ()) + tuple(map(_for_rerank, stage.checks)),
        stage.joins,
        rerank=True,
    )
    for k, stage in enumerate(RULES)
)


def validate_rerank(request: RerankRequest, info: ModelInfo, limits: Limits) -> Resolved:
    """The score request that computes the rerank, resolved on `info`; raise PoolingError
    for the first stage of RERANK_RULES that finds violations."""
    return _validate(resolve(request.score, info, request), limits, RERANK_RULES)


# Enum values a door could not map onto the engine's types. An engine request cannot hold
# a value its enum lacks, so the door asks this table as it maps (`unknown_value`), before
# any stage of RULES; the door keeps only the mapping. Keyed by field path; the


UNKNOWN_VALUES: dict[str, tuple[str, str]] = {
    "encoding": ("ENCODING_UNKNOWN", "unknown encoding value {value}"),  # gRPC's enum
    "params.task": ("TASK_UNKNOWN", "unknown task value {value}"),  # gRPC's enum
    "encoding_format": ("ENCODING_UNKNOWN", "must be float, base64, bytes or bytes_only"),
    "embed_dtype": (  # vLLM's, for base64's bytes
        "ENCODING_UNKNOWN",
        "must be float32, float16, bfloat16, fp8_e4m3 or fp8_e5m2",
    ),
    "endianness": ("ENCODING_UNKNOWN", "must be native, big or little"),  # vLLM's
    "task": (  # vLLM's /pooling
        "TASK_UNKNOWN",
        "must be embed, classify, token_embed, token_classify, embed_multi or embed_outputs",
    ),
    "late_chunking.rule": ("CHUNK_RULE_UNKNOWN", "unknown rule {value}: sentences or tokens"),
    "outputs": ("OUTPUT_UNKNOWN", "unknown output {value}: dense, sparse or multi"),  # /pooling
}


def unknown_value(path: str, value: object) -> PoolingError:
    """The refusal of `value` at `path`, which the door's mapping does not know."""
    reason, description = UNKNOWN_VALUES[path]
    violation = FieldViolation(path, description.format(value=value), reason)
    return PoolingError.invalid([violation])


def unknown_token_id(path: str, value: int, vocabulary: int) -> PoolingError:
    """An id to decode that names no token of the model's vocabulary."""
    description = f"{clip(str(value), 32)} is not a token id (0 to {vocabulary - 1})"
    return PoolingError.invalid([FieldViolation(path, description, "TOKEN_ID_INVALID")])
