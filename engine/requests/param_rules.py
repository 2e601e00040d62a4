"""The parameter rules, read on the model: parameters the task takes, matryoshka
dimensions, truncate_prompt_tokens, sparse top_k, and the output encoding with the
calibration ranges it may need."""

from __future__ import annotations

from collections.abc import Iterator

from pooling_server.engine.errors import FieldViolation
from pooling_server.engine.requests.encodings import CALIBRATION_FILES, NEEDS_RANGES
from pooling_server.engine.requests.params import TASK_PARAMS, OutputEncoding, Task
from pooling_server.engine.requests.resolved import Limits, Resolved


def params_for_task(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
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


def dimensions(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
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


def truncate(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
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


def sparse_top_k(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
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


def encoding(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
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


def calibration(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
    request, info = r.request, r.info
    if request.encoding in NEEDS_RANGES and info.calibration_ranges is None:
        files = " or ".join(CALIBRATION_FILES)
        yield FieldViolation(
            "encoding",
            f'{request.encoding} needs calibration ranges, and model "{info.name}" has none '
            f"(ship {files} in its folder); use binary, ubinary, float16 or bfloat16 instead",
            "CALIBRATION_RANGES_MISSING",
        )
