"""A bge-m3 model's rows of the validation table: the outputs embed_outputs asks for,
output_weights (theirs alone), lexical weights with no unsaturated form; why a model
lacks embed_outputs; and the size of its outputs counted before the forward pass."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from pooling_server.engine.errors import FieldViolation
from pooling_server.engine.families.bge_m3.multi_output import MultiOutputSettings
from pooling_server.engine.models.model_info import ModelInfo
from pooling_server.engine.requests.output_size import ResponseBudget, matrix_bytes, sparse_bytes
from pooling_server.engine.requests.params import Output, Task
from pooling_server.engine.requests.resolved import Limits, Resolved


def outputs_asked(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
    """embed_outputs names the outputs it wants: at least one."""
    request = r.request
    if request.task is Task.EMBED_OUTPUTS and not request.outputs:
        yield FieldViolation(
            "embed_outputs",
            "ask for at least one output: set dense, sparse or multi",
            "OUTPUTS_NONE",
        )


def output_weights_elsewhere(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
    """output_weights weigh a multi-output model's three scores: no other model has them
    (run on the models of every other family)."""
    request, info = r.request, r.info
    if request.params.output_weights is None or request.task is not Task.SCORE:
        return  # on other tasks, _params_for_task refuses it
    yield FieldViolation(
        "params.output_weights",
        f'model "{info.name}" is not a multi-output (bge-m3) model: output_weights weigh '
        "the dense, sparse and multi scores of one; leave it unset",
        "OUTPUT_WEIGHTS_NOT_SUPPORTED",
    )


def output_weights(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
    """Weights of a mean: none negative (or not a number), at least one positive."""
    weights = r.request.params.output_weights
    if weights is None or r.request.task is not Task.SCORE:
        return
    values = {output: weights.of(output) for output in Output}
    bad = [f"{o.value} {v}" for o, v in values.items() if not (0 <= v < float("inf"))]
    if bad or not any(values.values()):
        problem = f"got {', '.join(bad)}" if bad else "all are 0"
        yield FieldViolation(
            "params.output_weights",
            "output_weights must be finite and non-negative, with at least one positive "
            f"(the combined score is their weighted mean); {problem}",
            "OUTPUT_WEIGHTS_INVALID",
        )


def sparse_activation(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
    """Lexical weights are relu(sparse_linear(h)): use_activation=false has nothing else
    to return."""
    request = r.request
    if request.task is Task.EMBED_SPARSE and request.params.use_activation is False:
        yield FieldViolation(
            "params.use_activation",
            f'model "{r.info.name}" gives lexical weights as relu(sparse_linear(h)), with no '
            "other form to return; leave use_activation unset",
            "USE_ACTIVATION_NOT_SUPPORTED",
        )


def task_hint(task: Task, info: ModelInfo) -> str:
    if task is Task.EMBED_OUTPUTS:
        return (
            " (embed_outputs needs a multi-output model: a bge-m3 folder with "
            "sparse_linear.pt and colbert_linear.pt beside its encoder)"
        )
    return ""


def rows_bytes(r: Resolved, tokens: Sequence[int], budget: ResponseBudget) -> int:
    """embed_outputs (and embed_multi): the dense vector, a weight per token and a ColBERT
    row per token after the first (bge-m3 drops the cls token's)."""
    request, settings = r.request, r.info.settings
    assert isinstance(settings, MultiOutputSettings)
    encoding = request.encoding
    after_first = [max(n - 1, 0) for n in tokens]
    wanted = request.outputs if request.task is Task.EMBED_OUTPUTS else {Output.MULTI}
    total = len(tokens) * budget.item_bytes  # each text's outputs, framed
    if Output.DENSE in wanted:
        total += matrix_bytes([1] * len(tokens), settings.hidden, encoding, budget)
    if Output.SPARSE in wanted:
        total += sparse_bytes(after_first, budget)
    if Output.MULTI in wanted:
        total += matrix_bytes(after_first, settings.multi_width, encoding, budget)
    return total
