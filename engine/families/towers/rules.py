"""The two-tower families' part in zero-shot classification (torch-free): their models
classify over the labels a request names, in the model's template (Family.label_template),
and refuse classify without them. The label rules that every model runs are generic
(requests/label_rules.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from pooling_server.engine.errors import FieldViolation
from pooling_server.engine.requests.params import Task

if TYPE_CHECKING:
    from pooling_server.engine.models.model_info import ModelInfo
    from pooling_server.engine.requests.resolved import Limits, Resolved


def label_template(info: ModelInfo) -> str:
    """The model's template for candidate labels (--label-template, or its family's)."""
    return info.settings.label_template


def zero_shot_labels(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
    """A two-tower model has no labels of its own: classify names them."""
    request, info = r.request, r.info
    if request.task is Task.CLASSIFY and not request.candidate_labels:
        yield FieldViolation(
            "classify.candidate_labels",
            f'model "{info.name}" classifies zero-shot: send candidate_labels (each put in '
            f'label_template, by default "{label_template(info)}")',
            "CANDIDATE_LABELS_MISSING",
        )
