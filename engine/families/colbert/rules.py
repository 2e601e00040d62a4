"""A ColBERT model's rules: why a model lacks embed_multi, and the size of its matrices
counted before the forward pass (requests/validation.py asks through the Family)."""

from __future__ import annotations

from collections.abc import Sequence

from pooling_server.engine.families.colbert.multi_vector import MultiVectorSettings, query_mode
from pooling_server.engine.models.model_info import ModelInfo
from pooling_server.engine.requests.output_size import ResponseBudget, matrix_bytes
from pooling_server.engine.requests.params import Task
from pooling_server.engine.requests.resolved import Resolved


def task_hint(task: Task, info: ModelInfo) -> str:
    """embed_multi, on any model that lacks it; a single vector, on a ColBERT model."""
    if task is Task.EMBED_MULTI:
        return (
            " (embed_multi needs a multi-vector ColBERT model: a PyLate or MultiVectorEncoder"
            " folder)"
        )
    if isinstance(info.settings, MultiVectorSettings) and task in (Task.EMBED, Task.TOKEN_EMBED):
        return " (a multi-vector ColBERT model gives one matrix per text by embed_multi)"
    return ""


def _query(r: Resolved) -> bool:
    request = r.request
    return query_mode(request.prompt_name, request.prompt, r.info.default_prompt_name)


def rows_cap(r: Resolved) -> int | None:
    """The most tokens a text of embed_multi keeps: its mode's length, as the plan cuts it."""
    settings = r.info.settings
    assert isinstance(settings, MultiVectorSettings)
    return settings.kept_tokens(_query(r), r.truncate, r.info.max_input_tokens)


def rows_bytes(r: Resolved, tokens: Sequence[int], budget: ResponseBudget) -> int:
    """embed_multi's matrices: a row per token, a query's filled up to its length."""
    settings = r.info.settings
    assert isinstance(settings, MultiVectorSettings)
    width = settings.dimension or r.info.hidden_size
    if _query(r) and settings.query_expansion and settings.query_length:
        tokens = [max(n, settings.query_length) for n in tokens]
    return matrix_bytes(tokens, width, r.request.encoding, budget)
