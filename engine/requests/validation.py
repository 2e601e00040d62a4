"""Every request rule, in one table. Nothing invalid reaches a model.

Rules run in stages: the shape of the input, then whether the model can run the
task, then the parameters. A stage with violations stops validation, so later
rules can rely on what earlier ones checked. Field paths follow the wire schema
(`embed.texts[3]`, `params.dimensions`) because the input case is named by the task.

Validation returns the request `Resolved` on its model: the prompt text, the long-input
policy (reject, truncate or chunk), the truncation and its side, decided once by
`resolve` and read as they are by the rules, the planner and the engine. Three tables:
RULES (before tokenizing, on the event loop; a family's rules join their stages),
TOKENIZED_RULES (token counts, on a tokenizer thread: size_rules.py, with the answer's size)
and UNKNOWN_VALUES (enum values a door cannot map, as it decodes). `Resolved` and `Limits`
are in resolved.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence, Set
from dataclasses import dataclass, replace
from typing import Any

from pooling_server.engine.errors import ErrorKind, FieldViolation, PoolingError, clip
from pooling_server.engine.families import ORDER, family
from pooling_server.engine.models.model_info import (
    HeadKind,
    ModelInfo,
    PoolingType,
)
from pooling_server.engine.requests.encodings import CALIBRATION_FILES, NEEDS_RANGES
from pooling_server.engine.requests.output_size import (
    ResponseBudget,
    fewest_tokens,
    tokenize_bytes,
)
from pooling_server.engine.requests.params import (
    PROMPT_TASKS,
    TASK_PARAMS,
    OutputEncoding,
    Task,
)
from pooling_server.engine.requests.request import (
    ChunkRule,
    Image,
    Item,
    PoolRequest,
    RerankRequest,
)
from pooling_server.engine.requests.resolved import TOKEN_TASKS as TOKEN_TASKS
from pooling_server.engine.requests.resolved import Check as Check
from pooling_server.engine.requests.resolved import Limits as Limits
from pooling_server.engine.requests.resolved import Resolved as Resolved
from pooling_server.engine.requests.resolved import list_path
from pooling_server.engine.requests.resolved import prompt_text as prompt_text
from pooling_server.engine.requests.resolved import resolve as resolve
from pooling_server.engine.requests.size_rules import TOKENIZED_RULES as TOKENIZED_RULES
from pooling_server.engine.requests.size_rules import answer_size
from pooling_server.engine.requests.size_rules import check_token_output as check_token_output
from pooling_server.engine.requests.size_rules import (
    check_tokenize_output as check_tokenize_output,
)
from pooling_server.engine.requests.size_rules import check_tokenized as check_tokenized
from pooling_server.engine.requests.size_rules import output_too_large as output_too_large
from pooling_server.engine.requests.size_rules import output_violation as output_violation
from pooling_server.engine.requests.size_rules import response_budget as response_budget
from pooling_server.engine.requests.size_rules import rows_bytes as rows_bytes

INPUT_CASES = ", ".join(task.value for task in Task)


# Identifiers are echoed in answers and logs: bounded, so neither can be made huge.
MAX_REQUEST_ID_BYTES = 256
MAX_MODEL_NAME_CHARS = 256
# Which models take each input other than text (for a refusal's message).
MODELS_BY_MODALITY = {"image": "CLIP, SigLIP", "audio": "CLAP"}


def _input_present(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
    request = r.request
    if request.task is None:
        yield FieldViolation("input", f"set one input case: {INPUT_CASES}", "INPUT_MISSING")


def _input_not_empty(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
    request = r.request
    if request.task is None:
        return
    if request.task is Task.SCORE:
        for name in ("text_1", "text_2"):
            items = f"items_{name[-1]}"
            if not getattr(request, name) and not getattr(request, items):
                yield FieldViolation(f"score.{name}", "must hold at least one text", "EMPTY_INPUT")
    elif not request.texts and not request.items:
        yield FieldViolation(f"{request.task}.texts", "must hold at least one text", "EMPTY_INPUT")


def _score_shape(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
    request = r.request
    n1 = len(request.text_1 or request.items_1)
    n2 = len(request.text_2 or request.items_2)
    if request.task is Task.SCORE and n1 and n2 and n1 != 1 and n1 != n2:
        second = "score.items_2" if request.items_2 else "score.text_2"
        yield FieldViolation(
            second,
            f"the first side has {n1} inputs and the second {n2}: send one first input (1:N) "
            "or as many first inputs as second (N:N)",
            "SCORE_SHAPE_MISMATCH",
        )


def _batch_size(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
    request = r.request
    if request.task is not None and request.num_items > limits.max_client_batch_size:
        path = list_path(request)
        yield too_many_inputs(path, request.num_items, limits.max_client_batch_size)


def too_many_inputs(path: str, count: int | None, limit: int) -> FieldViolation:
    """The violation of a list over the per-request limit. The doors count on the wire,
    before any text is built: gRPC stops counting at limit + 1 (`count` None)."""
    counted = f"more than {limit}" if count is None else str(count)
    return FieldViolation(
        path,
        f"{counted} inputs exceed the limit of {limit} per request "
        "(--max-client-batch-size); split the request or use PoolStream",
        "TOO_MANY_INPUTS",
    )


def request_id_too_long(request_id: str) -> bool:
    return len(request_id.encode()) > MAX_REQUEST_ID_BYTES


def _request_id(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
    request = r.request
    if request_id_too_long(request.request_id):
        yield FieldViolation(
            "request_id",
            f"request_id has {len(request.request_id.encode())} bytes, more than "
            f"{MAX_REQUEST_ID_BYTES}",
            "REQUEST_ID_TOO_LONG",
        )


def stream_request_id_error(request_id: str, seen: Set[str], index: int) -> PoolingError | None:
    """The rule for the id of stream message `index`: present, not too long, and not one
    an earlier message of the stream used (`seen`), since answers come back in any order
    and the id is all that pairs them with their requests."""
    too_long = request_id_too_long(request_id)
    if request_id and request_id not in seen and not too_long:
        return None
    metadata = {}
    if not request_id:
        reason, problem = "REQUEST_ID_MISSING", "request_id is required on a stream"
    elif too_long:
        reason = "REQUEST_ID_TOO_LONG"
        problem = f"request_id has more than {MAX_REQUEST_ID_BYTES} bytes"
    else:
        reason, problem = "REQUEST_ID_DUPLICATE", "request_id repeats an earlier request_id"
        metadata["request_id"] = request_id
    return PoolingError(
        ErrorKind.INVALID_ARGUMENT,
        reason,
        problem,
        (FieldViolation(f"messages[{index}].request.request_id", problem, reason),),
        metadata=metadata,
    )


def _inputs(request: PoolRequest) -> Iterator[tuple[str, Sequence[str]]]:
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


# ---- image models: items (texts and images), zero-shot classification

# The tasks whose requests may carry items (TextInput.items, ScoreInput.items_1/items_2).
ITEM_TASKS = frozenset({Task.EMBED, Task.CLASSIFY, Task.SCORE})
DEFAULT_LABEL_TEMPLATE = "a photo of a {label}."


def item_lists(request: PoolRequest) -> Iterator[tuple[str, tuple[Item, ...]]]:
    """Each item list a request carries, with its field path."""
    if request.task is Task.SCORE:
        for path, items in (("score.items_1", request.items_1), ("score.items_2", request.items_2)):
            if items:
                yield path, items
    elif request.items and request.task is not None:
        yield f"{request.task}.items", request.items


def _items_shape(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
    """Items stand in place of texts: never both in one list, only where a task takes
    them, and no more images than the limit per request."""
    request = r.request
    if request.task is None or not (request.items or request.items_1 or request.items_2):
        return  # a text request: nothing to check (the usual case, kept cheap)
    given = list(item_lists(request))
    if request.task not in ITEM_TASKS:
        yield FieldViolation(
            given[0][0],
            f"items (texts and images) are for embed, classify and score, not {request.task}; "
            "send texts",
            "ITEMS_NOT_SUPPORTED_FOR_TASK",
        )
        return
    if request.task is Task.SCORE:
        lists = [
            ("score.text_1", request.text_1, request.items_1),
            ("score.text_2", request.text_2, request.items_2),
        ]
    else:
        lists = [(f"{request.task}.texts", request.texts, request.items)]
    for path, texts, items in lists:
        if texts and items:
            yield FieldViolation(
                path,
                "send texts or items, not both: items hold texts and images together",
                "ITEMS_AND_TEXTS",
            )
    images = sum(isinstance(item, Image) for _, items in given for item in items)
    if images > limits.max_images_per_request:
        yield FieldViolation(
            given[-1][0],
            f"{images} images exceed the limit of {limits.max_images_per_request} per request "
            "(--max-images-per-request); split the request",
            "TOO_MANY_IMAGES",
        )


def _candidate_labels(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
    """Zero-shot labels belong to classify: each non-blank, no more than a request's
    inputs, in a template that places the label."""
    request = r.request
    labels, template = request.candidate_labels, request.label_template
    path = "classify.candidate_labels"
    if not labels:
        if template is not None and request.task is Task.CLASSIFY:
            yield FieldViolation(
                "classify.label_template",
                "label_template shapes candidate_labels, and there are none; send some",
                "CANDIDATE_LABELS_MISSING",
            )
        return
    if request.task is not Task.CLASSIFY:
        yield FieldViolation(
            path,
            f"candidate labels are for zero-shot classify, not {request.task}",
            "CANDIDATE_LABELS_NOT_SUPPORTED_FOR_TASK",
        )
        return
    if len(labels) > limits.max_client_batch_size:
        yield too_many_inputs(path, len(labels), limits.max_client_batch_size)
        return
    for i, label in enumerate(labels):
        if not label.strip():
            yield FieldViolation(
                f"{path}[{i}]", "a label must not be blank", "CANDIDATE_LABEL_EMPTY"
            )
    if template is not None and "{label}" not in template:
        yield FieldViolation(
            "classify.label_template",
            'the template must hold "{label}", where each candidate label goes '
            f'(default "{DEFAULT_LABEL_TEMPLATE}")',
            "LABEL_TEMPLATE_INVALID",
        )
    limit = r.info.char_limit(r.may_run_long)
    towers = r.info.towers
    default = towers.label_template if towers is not None else DEFAULT_LABEL_TEMPLATE
    reads = max((template or default).count("{label}"), 1)  # a template may repeat it
    longest = reads * max(len(label) for label in labels) + len(template or default)
    if longest > limit:
        yield FieldViolation(
            path,
            f"a label in its template has {longest} characters, more than this model's "
            f"limit of {limit}",
            "INPUT_TOO_LONG",
        )


def _modalities(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
    """An image or audio clip needs a model that takes it (ModelCard.modalities), as
    zero-shot labels need a two-tower model."""
    request, info = r.request, r.info
    if request.items or request.items_1 or request.items_2:
        for path, items in item_lists(request):
            for i, item in enumerate(items):
                if type(item) is not str and item.modality not in info.modalities:
                    takes = " and ".join(info.modalities)
                    yield FieldViolation(
                        f"{path}[{i}].{item.modality}",
                        f'model "{info.name}" takes {takes} inputs; send {item.modality} '
                        f"inputs to a model whose modalities include {item.modality} "
                        f"({MODELS_BY_MODALITY.get(item.modality, '')})",
                        "MODALITY_NOT_SUPPORTED",
                    )
                    return
    if request.candidate_labels:
        yield from _zero_shot_model(request, info)


def _zero_shot_model(request: PoolRequest, info: ModelInfo) -> Iterator[FieldViolation]:
    """Candidate labels on classify need an image model (one without classify at all is
    _task_supported's to refuse)."""
    classifies = request.task is Task.CLASSIFY and Task.CLASSIFY in info.tasks
    if classifies and info.towers is None:
        yield FieldViolation(
            "classify.candidate_labels",
            f'model "{info.name}" classifies into its own labels; zero-shot candidate labels '
            "need an image-text or audio-text model (CLIP, SigLIP, CLAP)",
            "ZERO_SHOT_NOT_SUPPORTED",
        )


def _characters(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
    """Bound every text, and all of them, by characters before anything is tokenized."""
    request, info = r.request, r.info
    if request.task is None or request.num_items > limits.max_client_batch_size:
        return  # _batch_size speaks for a request this large
    lists = list(_inputs(request))
    whole = "score" if request.task is Task.SCORE else lists[0][0]
    prompt = len(r.prompt or "")  # counted with every text it precedes
    limit = info.char_limit(r.may_run_long)
    if request.task is Task.SCORE and info.is_cross_encoder:
        return  # pairs read as one sequence: its family bounds them (pair_bounds)
    yield from _character_bounds(lists, whole, limit, limits, prompt)
    if request.candidate_labels and request.task is Task.CLASSIFY:
        yield from _label_total(r, limits, sum(len(t) + prompt for _, ts in lists for t in ts))


def pair_bounds(r: Resolved, limits: Limits, template: Any = None) -> Iterator[FieldViolation]:
    """For a model that reads each score pair as one sequence (a cross-encoder; an LLM
    reranker, through its `template`: a ScoreTemplate): every text within the model's
    limit, an instruction too; and the pairs as they are built (each text_1 with each of
    its text_2, in the template with the instruction) within the request bound: what a
    request multiplies counts as often as it is read, before any pair's text is built."""
    request, info = r.request, r.info
    if request.task is not Task.SCORE or request.num_items > limits.max_client_batch_size:
        return  # _batch_size speaks for a request this large
    lists = list(_inputs(request))
    limit = info.char_limit(r.may_run_long)
    instruction = request.prompt
    unbounded = Limits(max_request_chars=1 << 62)  # the pairs' total is counted below
    yield from _character_bounds(lists, "score", limit, unbounded)
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
        return  # _input_not_empty and _score_shape speak for it
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


def _label_total(r: Resolved, limits: Limits, texts: int) -> Iterator[FieldViolation]:
    """Zero-shot labels are texts too, each read in its template: counted with the
    request's texts against the request bound (their lengths are _candidate_labels')."""
    towers = r.info.towers
    template = r.request.label_template
    if template is None:
        template = towers.label_template if towers is not None else DEFAULT_LABEL_TEMPLATE
    labels = r.request.candidate_labels
    reads = max(template.count("{label}"), 1)  # each label as often as its template reads it
    total = texts + reads * sum(map(len, labels)) + len(labels) * len(template)
    if total > limits.max_request_chars >= texts:
        yield FieldViolation(
            "classify.candidate_labels",
            f"the texts and the labels in their template hold {total} characters together, "
            f"more than the limit of {limits.max_request_chars} per request "
            "(--max-request-chars); send fewer or shorter labels",
            "REQUEST_TOO_LARGE",
        )


def _character_bounds(
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


def _task_agrees(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
    request = r.request
    declared = request.declared_task
    if declared is not None and request.task is not None and declared is not request.task:
        yield FieldViolation(
            "params.task",
            f"task {declared} disagrees with the input case {request.task}",
            "TASK_MISMATCH",
        )


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


def _late_chunking(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
    """Late chunking's shape: embed only, spans or a rule (not both), the rule's window and
    overlap in range, and spans of the one text, each non-empty and inside it. Spans may
    overlap and come in any order (each chunk is computed on its own)."""
    request, chunking = r.request, r.request.late_chunking
    if chunking is None:
        return
    path = "late_chunking"
    if request.task is not Task.EMBED:
        yield FieldViolation(
            path,
            f"late chunking embeds chunks of a text: it applies to embed only, not {request.task}",
            "LATE_CHUNKING_TASK",
        )
        return
    if request.params.truncate_prompt_tokens is not None:
        yield FieldViolation(
            "params.truncate_prompt_tokens",
            "late chunking reads the whole text (in macro-windows past the maximum length): "
            "leave truncate_prompt_tokens unset",
            "LATE_CHUNKING_TRUNCATE",
        )
    if bool(chunking.spans) == (chunking.rule is not None):
        yield FieldViolation(
            path,
            "give either spans or a rule (sentences, or tokens with a window), not "
            + ("both" if chunking.spans else "neither"),
            "LATE_CHUNKING_SHAPE",
        )
        return
    if chunking.rule is ChunkRule.TOKENS:
        if chunking.window < 1:
            yield FieldViolation(
                f"{path}.window",
                f"the tokens rule needs a window of at least 1 token, got {chunking.window}",
                "LATE_CHUNKING_WINDOW",
            )
        elif not 0 <= chunking.overlap < chunking.window:
            yield FieldViolation(
                f"{path}.overlap",
                f"overlap must be from 0 to window - 1 ({chunking.window - 1}), "
                f"got {chunking.overlap}",
                "LATE_CHUNKING_OVERLAP",
            )
    elif chunking.window or chunking.overlap:
        yield FieldViolation(
            f"{path}.window",
            "window and overlap belong to the tokens rule; leave them unset",
            "LATE_CHUNKING_WINDOW",
        )
    if not chunking.spans:
        return
    if len(request.texts) != 1:
        yield FieldViolation(
            f"{path}.spans",
            f"spans are character spans of one text, and the request has {len(request.texts)}; "
            "send one text per request, or use a rule",
            "LATE_CHUNKING_SPANS_TEXTS",
        )
        return
    if len(chunking.spans) > limits.max_client_batch_size:
        yield too_many_inputs(f"{path}.spans", len(chunking.spans), limits.max_client_batch_size)
        return
    length = len(request.texts[0])
    for i, (start, end) in enumerate(chunking.spans):
        if start < 0 or end > length:
            problem, reason = f"lies outside the text of {length} characters", "SPAN_OUT_OF_TEXT"
        elif start > end:
            problem, reason = "ends before it starts", "SPAN_REVERSED"
        elif start == end:
            problem, reason = "is empty", "SPAN_EMPTY"
        else:
            continue
        yield FieldViolation(f"{path}.spans[{i}]", f"[{start}, {end}) {problem}", reason)


def _late_chunking_model(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
    """A chunk's vector is the mean of its token states: the model must pool by mean."""
    request, info = r.request, r.info
    if request.late_chunking is None or request.task is not Task.EMBED:
        return
    if info.head is not HeadKind.HIDDEN or info.pooling_type is not PoolingType.MEAN:
        yield FieldViolation(
            "late_chunking",
            f'model "{info.name}" pools by {info.pooling_type}, and late chunking averages '
            "token states: it needs a model with mean pooling",
            "LATE_CHUNKING_POOLING",
        )


def _params_for_task(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
    request = r.request
    assert request.task is not None
    allowed = TASK_PARAMS[request.task]
    for name in request.params.set_fields():
        if name not in allowed:
            accepted = ", ".join(sorted(allowed))
            yield FieldViolation(
                f"params.{name}",
                f"{name} is not valid for {request.task}; it accepts: {accepted}",
                "PARAM_NOT_SUPPORTED_FOR_TASK",
            )


def _dimensions(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
    request, info = r.request, r.info
    dims = request.params.dimensions
    if dims is None or "dimensions" not in TASK_PARAMS[request.task]:  # type: ignore[index]
        return
    field = "params.dimensions"
    if not info.is_matryoshka:
        yield FieldViolation(
            field,
            f'model "{info.name}" does not support matryoshka representation; changing '
            "the output dimensions would give poor results. Leave dimensions unset",
            "DIMENSIONS_NOT_SUPPORTED",
        )
    elif dims < 1 or dims > info.hidden_size:
        yield FieldViolation(
            field,
            f"dimensions must be between 1 and the hidden size {info.hidden_size}, got {dims}",
            "DIMENSIONS_OUT_OF_RANGE",
        )
    elif info.matryoshka_dimensions and dims not in info.matryoshka_dimensions:
        allowed = ", ".join(str(d) for d in info.matryoshka_dimensions)
        yield FieldViolation(
            field,
            f'model "{info.name}" only supports the matryoshka dimensions [{allowed}], got {dims}',
            "DIMENSIONS_NOT_SUPPORTED",
        )


def _truncate(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
    request, info = r.request, r.info
    n = request.params.truncate_prompt_tokens
    if n is None or n == -1:
        return
    if n < -1 or n == 0:
        problem = f"got {n}"
    elif n > info.max_input_tokens:
        problem = f"got {n}, above the model's maximum input length"
    elif n < info.num_special_tokens:
        problem = f"got {n}, fewer than the model's {info.num_special_tokens} special tokens"
    else:
        return
    yield FieldViolation(
        "params.truncate_prompt_tokens",
        f"truncate_prompt_tokens must be -1 (the maximum) or between {info.num_special_tokens} "
        f"and {info.max_input_tokens}; {problem}",
        "TRUNCATE_PROMPT_TOKENS_INVALID",
    )


def _prompt_conflict(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
    request = r.request
    if request.prompt is not None and request.prompt_name is not None:
        yield FieldViolation(
            "prompt",
            "set prompt_name (one of the model's prompts) or prompt (a text), not both",
            "PROMPT_CONFLICT",
        )


def _prompt_for_task(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
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


def _prompt_name(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
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


def _sparse_top_k(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
    request = r.request
    path = {
        Task.EMBED_SPARSE: "embed_sparse.top_k",
        Task.EMBED_OUTPUTS: "embed_outputs.sparse_top_k",
    }
    if request.task in path and request.sparse_top_k < 0:
        yield FieldViolation(
            path[request.task],  # type: ignore[index]
            f"top_k must be 0 (every non-zero weight) or a positive count, "
            f"got {request.sparse_top_k}",
            "TOP_K_INVALID",
        )


# Which tasks take an output encoding other than the default `repeated float`.
ENCODING_TASKS = frozenset({Task.EMBED, Task.TOKEN_EMBED, Task.EMBED_MULTI, Task.EMBED_OUTPUTS})


def _encoding(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
    request, info = r.request, r.info
    encoding = request.encoding
    if encoding is OutputEncoding.FLOAT:
        return
    if request.task not in ENCODING_TASKS:
        yield FieldViolation(
            "encoding",
            f"encoding {encoding} is only for embed, token_embed, embed_multi and "
            f"embed_outputs, not "
            f"{request.task}; leave it unset",
            "ENCODING_NOT_SUPPORTED_FOR_TASK",
        )
        return
    ranges = info.calibration_ranges
    dims = request.params.dimensions
    if encoding in NEEDS_RANGES and ranges is not None and dims not in (None, len(ranges[0])):
        yield FieldViolation(
            "encoding",
            f'the calibration ranges of model "{info.name}" cover {len(ranges[0])} dimensions; '
            f"{encoding} cannot encode {dims}. Leave params.dimensions unset",
            "CALIBRATION_RANGES_DIMENSIONS",
        )


def _calibration(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
    request, info = r.request, r.info
    if request.encoding in NEEDS_RANGES and info.calibration_ranges is None:
        files = " or ".join(CALIBRATION_FILES)
        yield FieldViolation(
            "encoding",
            f'{request.encoding} needs calibration ranges, and model "{info.name}" has none '
            f"(ship {files} in its folder); use binary, ubinary, float16 or bfloat16 instead",
            "CALIBRATION_RANGES_MISSING",
        )


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
            _input_present,
            _input_not_empty,
            _score_shape,
            _batch_size,
            _task_agrees,
            _request_id,
            _prompt_conflict,
            _characters,
            _sparse_top_k,
            _late_chunking,
            _items_shape,
            _candidate_labels,
        ),
        joins="shape",
    ),
    Stage(
        ErrorKind.FAILED_PRECONDITION,
        (_task_supported, _late_chunking_model, _modalities),
        joins="model",
    ),
    Stage(
        ErrorKind.INVALID_ARGUMENT,
        (
            _params_for_task,
            _dimensions,
            _truncate,
            _encoding,
            _prompt_for_task,
            _prompt_name,
            answer_size,
        ),
        joins="params",
    ),
    Stage(ErrorKind.FAILED_PRECONDITION, (_calibration,)),
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
# description is formatted with the value received.
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
        _character_bounds([("texts", texts)], "texts", info.char_limit(long=True), limits)
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
