"""An LLM reranker's rows of the validation table."""

from __future__ import annotations

from collections.abc import Iterator

from pooling_server.engine.errors import FieldViolation
from pooling_server.engine.requests.character_rules import pair_bounds
from pooling_server.engine.requests.resolved import Limits, Resolved


def pairs_in_template(r: Resolved, limits: Limits) -> Iterator[FieldViolation]:
    """Each pair counted as read through the template, with the instruction."""
    yield from pair_bounds(r, limits, r.info.settings)
