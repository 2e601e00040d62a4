"""SPLADE's rows of the validation table."""

from __future__ import annotations

from collections.abc import Iterator

from pooling_server.engine.errors import FieldViolation
from pooling_server.engine.families.splade.settings import SpladeStrategy
from pooling_server.engine.requests.params import Task
from pooling_server.engine.requests.resolved import Limits, Resolved


def unsaturated_weights(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
    """use_activation=false skips SPLADE's log saturation after max pooling; sum pooling
    saturates each token before summing, so it has no unsaturated form to return."""
    request, info = r.request, r.info
    unsaturated = request.task is Task.EMBED_SPARSE and request.params.use_activation is False
    if unsaturated and info.settings.strategy is SpladeStrategy.SUM:
        yield FieldViolation(
            "params.use_activation",
            f'model "{info.name}" sums saturated SPLADE weights over tokens, so its weights '
            "cannot be returned unsaturated; leave use_activation unset",
            "USE_ACTIVATION_NOT_SUPPORTED",
        )
