"""Results the engine returns, one per text (or per pair for score), in input order."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pooling_server.engine.inputs.modality import Modality
from pooling_server.engine.requests.params import OutputEncoding, Task


@dataclass(frozen=True)
class Embedding:
    """`values` in float32; with an encoding other than FLOAT, `data` holds them packed as
    it says (engine/requests/encodings.py)."""

    values: np.ndarray
    encoding: OutputEncoding = OutputEncoding.FLOAT
    data: bytes = b""
    # What was embedded, as an image model reports it; None: a text of a text-only model.
    modality: Modality | None = None


@dataclass(frozen=True)
class Classification:
    """`probs` over the model's labels, or over the request's candidate labels (zero-shot
    on an image model: `label` is then the best candidate)."""

    probs: np.ndarray
    label_id: int
    label: str
    modality: Modality | None = None  # as Embedding's


@dataclass(frozen=True)
class Score:
    value: float


@dataclass(frozen=True)
class TokenRows:
    """One row per token; `label_ids`/`labels` only for token_classify; `encoding`/`data`
    as in Embedding (token_embed only), each row packed on its own."""

    values: np.ndarray
    token_ids: list[int]
    offsets: list[tuple[int, int]]
    special_tokens_mask: list[bool]
    label_ids: list[int] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)
    encoding: OutputEncoding = OutputEncoding.FLOAT
    data: bytes = b""


@dataclass(frozen=True)
class SparseEmbedding:
    """embed_sparse: the non-zero vocabulary weights of one text, by decreasing weight (ties
    by index); `tokens` (each index's token) only when the request asked for them."""

    indices: np.ndarray  # int32
    values: np.ndarray  # float32
    tokens: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class MultiVector:
    """embed_multi: one normalised, projected row per kept token (rows x dim, float32);
    `encoding`/`data` as in Embedding, the whole matrix packed row after row."""

    values: np.ndarray
    encoding: OutputEncoding = OutputEncoding.FLOAT
    data: bytes = b""


@dataclass(frozen=True)
class TextOutputs:
    """embed_outputs: one text's outputs of a multi-output model, those asked for set."""

    dense: Embedding | None = None
    sparse: SparseEmbedding | None = None
    multi: MultiVector | None = None


@dataclass(frozen=True)
class LateChunks:
    """embed with late chunking: one embedding per chunk of a text, each with its
    character span [start, end) in the text, in chunk order."""

    spans: list[tuple[int, int]]
    embeddings: list[Embedding]


ItemOutput = (
    Embedding
    | Classification
    | Score
    | TokenRows
    | SparseEmbedding
    | MultiVector
    | LateChunks
    | TextOutputs
)


@dataclass(frozen=True)
class PoolResult:
    request_id: str
    model: str
    task: Task
    prompt_tokens: int
    outputs: list[ItemOutput]
    # Of prompt_tokens, those answered without a forward of their own: the result cache
    # or another request's forward in flight (engine/caching; usage's cached tokens).
    cached_tokens: int = 0


@dataclass(frozen=True)
class Ranked:
    """One document's place in a rerank: its index in the request and its score."""

    index: int
    score: float
    modality: Modality | None = None  # the document's, where the request gave items


@dataclass(frozen=True)
class RerankResult:
    request_id: str
    model: str
    prompt_tokens: int
    ranking: list[Ranked]  # best first, at most top_n
    cached_tokens: int = 0  # as PoolResult's


# Past this many values, a door builds and encodes an answer on a worker thread: about 20 ms
# of the event loop's time in JSON, or a few ms of protobuf, that other calls would wait for.
OFF_LOOP_VALUES = 100_000


def values_in(result: object) -> int:
    """How many float values an answer carries: what building and encoding it costs, which
    decides whether a door does that on the event loop or on a worker thread."""
    if not isinstance(result, PoolResult):
        return 0
    total = 0
    for output in result.outputs:
        if isinstance(output, Classification):
            total += output.probs.size
        elif isinstance(output, (Embedding, TokenRows, MultiVector)):
            total += output.values.size
        elif isinstance(output, LateChunks):
            total += sum(embedding.values.size for embedding in output.embeddings)
        elif isinstance(output, TextOutputs):
            total += sum(part.values.size for part in (output.dense, output.multi) if part)
            total += output.sparse.values.size if output.sparse is not None else 0
    return total
