"""A two-tower model's own rows of the validation table (torch-free): the rules every
other model has no use for. CLAP's zero-shot is the same, so its family lists them too."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from pooling_server.engine.errors import FieldViolation
from pooling_server.engine.requests.params import Task

if TYPE_CHECKING:
    from pooling_server.engine.requests.validation import Limits, Resolved


def zero_shot_labels(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
    """A two-tower model has no labels of its own: classify names them."""
    request, info = r.request, r.info
    if request.task is Task.CLASSIFY and not request.candidate_labels:
        assert info.towers is not None
        yield FieldViolation(
            "classify.candidate_labels",
            f'model "{info.name}" classifies zero-shot: send candidate_labels (each put in '
            f'label_template, by default "{info.towers.label_template}")',
            "CANDIDATE_LABELS_MISSING",
        )
