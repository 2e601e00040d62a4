"""The Plan every planner returns (engine/requests/plans.py for text models, a family's
own plan for the others), and the finishing of one embedding that they share: dimensions,
normalisation, then the request's encoding."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pooling_server.engine.inputs.tokenization import TokenSequence
from pooling_server.engine.models.model_info import ModelInfo
from pooling_server.engine.requests.encodings import NEEDS_RANGES, encode, ranges_array
from pooling_server.engine.requests.heads import normalize, truncate_dimensions
from pooling_server.engine.requests.outputs import Embedding, ItemOutput
from pooling_server.engine.requests.params import OutputEncoding
from pooling_server.engine.requests.request import PoolRequest

Finish = Callable[[list[np.ndarray]], list[ItemOutput]]


@dataclass(frozen=True)
class Plan:
    # Per sequence, whether every token's state is wanted (True), its pooled vector
    # (False), or late chunking's token ranges, whose mean states come back (a tuple).
    work: list[tuple[TokenSequence, bool | tuple[int, ...]]]
    finish: Finish
    # Applied to each sequence's raw output as its batch ends (Job.fold): what `finish`
    # then gets for it. None: finish gets the raw outputs.
    fold: Callable[[int, np.ndarray], object] | None = None

    @property
    def prompt_tokens(self) -> int:
        return sum(len(sequence) for sequence, _ in self.work)


def use_activation(request: PoolRequest, default: bool) -> bool:
    value = request.params.use_activation
    return default if value is None else value


def encoded(request: PoolRequest, info: ModelInfo, values: np.ndarray) -> bytes:
    """The finished values packed in the request's encoding (after dimensions and
    normalisation, as sentence-transformers quantizes what encode returned)."""
    ranges = ranges_array(info.calibration_ranges) if request.encoding in NEEDS_RANGES else None
    return encode(values, request.encoding, ranges)


def finish_vector(request: PoolRequest, info: ModelInfo, values: np.ndarray) -> Embedding:
    """One pooled vector as embed answers it: the request's dimensions, normalised unless
    use_activation says otherwise, packed in its encoding."""
    values = truncate_dimensions(values, request.params.dimensions)
    if use_activation(request, info.default_normalize):
        values = normalize(values)
    values = values.astype(np.float32)
    if request.encoding is OutputEncoding.FLOAT:
        return Embedding(values)
    return Embedding(values, request.encoding, encoded(request, info, values))
