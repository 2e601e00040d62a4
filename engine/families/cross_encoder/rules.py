"""A cross-encoder's rows of the validation table."""

from __future__ import annotations

from collections.abc import Iterator

from pooling_server.engine.errors import FieldViolation
from pooling_server.engine.requests.character_rules import pair_bounds
from pooling_server.engine.requests.resolved import Limits, Resolved


def pairs_read_whole(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
    """A cross-encoder reads each score pair as one sequence: a shared text_1 counts once
    per pair (a classifier of several labels has no score: _task_supported refuses it)."""
    if r.info.is_cross_encoder:
        yield from pair_bounds(r, limits)
