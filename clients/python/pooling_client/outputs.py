"""Result classes mirroring vLLM's pooling outputs, and their conversion from wire messages.

Each converter turns one ``PoolResponse`` into one request output per input text (or text
pair), in input order, so results line up with ``vllm.LLM.embed``/``classify``/``score``/
``encode``. Token matrices become numpy float32 arrays when numpy is installed (an optional
extra) and plain row lists otherwise.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pooling_client import _encodings
from pooling_client.v1 import pooling_pb2

try:  # numpy is an optional extra; token matrices fall back to nested lists without it.
    import numpy as np
except ImportError:  # pragma: no cover - exercised only where numpy is absent
    np = None  # type: ignore[assignment]


@dataclass
class EmbeddingOutput:
    """One text's embedding (vLLM ``EmbeddingOutput``).

    ``embedding`` holds floats; with ``encoding`` "int8"/"uint8" one int per value, and with
    "binary"/"ubinary" one int per 8 values (the packed bits, as sentence-transformers'
    ``quantize_embeddings`` returns them). ``encoding`` is None for the default float values;
    ``data`` keeps the packed bytes as they came.
    """

    embedding: list[Any]
    encoding: str | None = None
    dimensions: int | None = None
    data: bytes = field(default=b"", repr=False)
    #: What was embedded: "text", "image" (an image-text model's image input) or "audio".
    modality: str = "text"

    @property
    def hidden_size(self) -> int:
        """Number of components (of the vector before any bit packing)."""
        return self.dimensions if self.dimensions is not None else len(self.embedding)

    def numpy(self) -> Any:
        """The embedding as a 1-D numpy array, of the dtype its encoding decodes to (float32
        by default; packed bits as int8/uint8). Needs numpy."""
        numpy = _encodings.require_numpy()
        if self.encoding is None:
            return numpy.asarray(self.embedding, dtype=numpy.float32)
        return _encodings.decode_array(self.data, self.encoding, 1, self.hidden_size)[0]


@dataclass
class ChunkedEmbeddingOutput:
    """One text's late chunks (embed with ``late_chunking``): each chunk's character span
    [start, end) in the text and its embedding, in chunk order."""

    spans: list[tuple[int, int]]
    embeddings: list[EmbeddingOutput]

    def numpy(self) -> Any:
        """The chunks' vectors as one (chunks, dimensions) array. Needs numpy."""
        numpy = _encodings.require_numpy()
        return numpy.stack([embedding.numpy() for embedding in self.embeddings])


@dataclass
class ClassificationOutput:
    """One text's class probabilities, or raw logits when use_activation is False."""

    probs: list[float]
    label_id: int
    label: str
    #: What was classified: "text", "image" or "audio" (zero-shot on a two-tower model).
    modality: str = "text"

    @property
    def num_classes(self) -> int:
        """Number of labels the model predicts over."""
        return len(self.probs)


@dataclass
class ScoringOutput:
    """One text pair's relevance score (vLLM ``ScoringOutput``)."""

    score: float


@dataclass
class PoolingOutput:
    """One text's per-token output (token_embed or token_classify).

    ``data`` has one row per token: a numpy float32 array of shape (rows, cols) when numpy is
    installed, else a list of row lists. ``label_ids``/``labels`` are filled for
    token_classify only.
    """

    data: Any
    token_ids: list[int] = field(default_factory=list)
    offsets: list[tuple[int, int]] = field(default_factory=list)
    special_tokens_mask: list[bool] = field(default_factory=list)
    label_ids: list[int] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)
    #: token_embed with an encoding: its name; ``data`` then holds the decoded values (the
    #: packed bits per row for "binary"/"ubinary"), in numpy's dtype for it when installed.
    encoding: str | None = None


@dataclass
class Usage:
    """The tokens a request used: prompt tokens only, as pooling generates none."""

    prompt_tokens: int
    total_tokens: int
    #: Of prompt_tokens, those the server's result cache answered (its --cache-mb).
    cached_tokens: int = 0

    @classmethod
    def from_proto(cls, usage: pooling_pb2.Usage) -> Usage:
        """Convert a Usage message."""
        return cls(usage.prompt_tokens, usage.total_tokens, usage.cached_tokens)


@dataclass
class RerankOutput:
    """One document's place in a ranking: its position in the documents sent, its score
    (higher is more relevant) and, when asked for, its text."""

    index: int
    relevance_score: float
    document: str | None = None


@dataclass
class RerankRequestOutput:
    """A rerank's results, most relevant first (at most top_n), and the tokens it used.

    Iterating over it, indexing it and ``len`` go to ``results``.
    """

    request_id: str
    model: str
    results: list[RerankOutput]
    usage: Usage

    def __iter__(self) -> Iterator[RerankOutput]:
        return iter(self.results)

    def __len__(self) -> int:
        return len(self.results)

    def __getitem__(self, position: int) -> RerankOutput:
        return self.results[position]


@dataclass
class EmbeddingRequestOutput:
    """The embedding of one input text."""

    request_id: str
    outputs: EmbeddingOutput | ChunkedEmbeddingOutput


@dataclass
class ClassificationRequestOutput:
    """The classification of one input text."""

    request_id: str
    outputs: ClassificationOutput


@dataclass
class ScoringRequestOutput:
    """The score of one input text pair."""

    request_id: str
    outputs: ScoringOutput


@dataclass
class PoolingRequestOutput:
    """The per-token output of one input text."""

    request_id: str
    outputs: PoolingOutput


@dataclass
class SparseEmbeddingOutput:
    """One text's sparse (SPLADE) embedding: the vocabulary indices with a non-zero weight,
    by decreasing weight, and their weights; ``tokens`` (each index's token string) only
    when ``return_tokens`` was asked for."""

    indices: list[int]
    values: list[float]
    tokens: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[int, float]:
        """{vocabulary index: weight}."""
        return dict(zip(self.indices, self.values, strict=True))

    def decode(self) -> list[tuple[str, float]]:
        """(token, weight) pairs by decreasing weight, as sentence-transformers'
        ``SparseEncoder.decode`` gives them; needs ``return_tokens=True``."""
        if len(self.tokens) != len(self.indices):
            raise ValueError("this output has no tokens: call embed_sparse(return_tokens=True)")
        return list(zip(self.tokens, self.values, strict=True))


@dataclass
class SparseEmbeddingRequestOutput:
    """The sparse embedding of one input text."""

    request_id: str
    outputs: SparseEmbeddingOutput


def _enum_suffix(enum: Any, value: int, prefix: str) -> str:
    """Lower-case short name of an enum value ("POOLING_TASK_EMBED" -> "embed").

    Values this client does not know (a newer server) come back as their number.
    """
    try:
        name = enum.Name(value)
    except ValueError:
        return str(value)
    return name.removeprefix(prefix).lower()


def _spans(spans: Iterable[pooling_pb2.TokenSpan]) -> list[tuple[int, int]]:
    return [(span.start, span.end) for span in spans]


@dataclass
class ModelInfo:
    """One served model and what it can do (from a ``ModelCard``)."""

    name: str
    tasks: list[str]
    hidden_size: int
    max_input_tokens: int
    is_matryoshka: bool
    matryoshka_dimensions: list[int]
    labels: list[str]
    pooling_type: str | None
    default_use_activation: bool
    is_default: bool
    architecture: str
    truncation_side: str
    long_input: str
    #: Whether the "int8" and "uint8" encodings are available (the model has calibration
    #: ranges, shipped or computed at load).
    has_calibration_ranges: bool = False
    #: Prompts by name (sentence-transformers' ``prompts``), for ``embed(prompt_name=...)``.
    prompts: dict[str, str] = field(default_factory=dict)
    #: The prompt applied when a request names none ("" for none).
    default_prompt_name: str = ""
    #: The weights' dtype and device, e.g. "float32" and "cpu"; the hub revision ("" locally).
    dtype: str = ""
    device: str = ""
    revision: str = ""
    #: What runs the forward ("torch", "onnx", "openvino"), its precision ("float32",
    #: "int8") and the export file it runs ("" for torch).
    backend: str = ""
    precision: str = ""
    backend_file: str = ""
    engines_per_device: int = 1
    #: Where the int8/uint8 ranges came from: "folder" (shipped with the model), "computed"
    #: (from calibration texts at load), or "" when the model has none.
    calibration_source: str = ""
    #: A multi-vector (ColBERT) model's modes: query_prefix, document_prefix,
    #: query_length, document_length, query_expansion, attend_to_expansion_tokens and
    #: skiplist_words; empty for other models.
    multi_vector: dict[str, Any] = field(default_factory=dict)
    #: An LLM reranker's score template source: "--score-template", "score_template.json"
    #: or "chat_template"; "" for other models (only an LLM reranker takes an instruction).
    score_template_source: str = ""
    #: The inputs the model accepts: "text", and "image" for CLIP and SigLIP models, "audio"
    #: for CLAP models.
    modalities: list[str] = field(default_factory=lambda: ["text"])
    #: An image model's input size in pixels (its processor's, e.g. 224); 0 for others.
    image_size: int = 0
    #: A multi-output (bge-m3) model's outputs: "dense", "sparse" and "multi"; [] for others.
    outputs: list[str] = field(default_factory=list)
    #: "loaded" for a served model; what its weights take in memory, in bytes (per engine).
    state: str = "loaded"
    memory_bytes: int = 0

    @classmethod
    def from_proto(cls, card: pooling_pb2.ModelCard) -> ModelInfo:
        """Convert a ModelCard; tasks and pooling_type become short names like "embed", "mean"."""
        tasks = [
            _enum_suffix(pooling_pb2.PoolingTask, task, "POOLING_TASK_")
            for task in card.tasks
            if task != pooling_pb2.POOLING_TASK_UNSPECIFIED
        ]
        pooling_type = None
        if card.pooling_type != pooling_pb2.POOLING_TYPE_UNSPECIFIED:
            pooling_type = _enum_suffix(pooling_pb2.PoolingType, card.pooling_type, "POOLING_TYPE_")
        return cls(
            name=card.name,
            tasks=tasks,
            hidden_size=card.hidden_size,
            max_input_tokens=card.max_input_tokens,
            is_matryoshka=card.is_matryoshka,
            matryoshka_dimensions=list(card.matryoshka_dimensions),
            labels=list(card.labels),
            pooling_type=pooling_type,
            default_use_activation=card.default_use_activation,
            is_default=card.is_default,
            architecture=card.architecture,
            truncation_side=card.truncation_side,
            long_input=card.long_input,
            has_calibration_ranges=card.has_calibration_ranges,
            prompts=dict(card.prompts),
            default_prompt_name=card.default_prompt_name,
            dtype=card.dtype,
            device=card.device,
            revision=card.revision,
            backend=card.backend,
            precision=card.precision,
            backend_file=card.backend_file,
            engines_per_device=card.engines_per_device or 1,
            calibration_source=card.calibration_source,
            multi_vector=_multi_vector_settings(card),
            score_template_source=card.score_template_source,
            modalities=_modalities(card),
            image_size=card.image_size,
            outputs=list(card.outputs),
            state=_state(card.state) or "loaded",
            memory_bytes=card.memory_bytes,
        )


@dataclass
class RepositoryModel:
    """One model the server's repository knows, and where it stands (a ``RepositoryModel``):
    ``state`` is "loaded", "loading", "available", "failed" or "unloading"."""

    name: str
    state: str
    source: str = ""
    #: What its weights take in memory, in bytes (per engine), while loaded.
    memory_bytes: int = 0
    #: Why its last load failed; a failed model is refused until ``retry_after_s`` passes.
    reason: str = ""
    retry_after_s: float = 0.0
    load_seconds: float = 0.0
    in_flight: int = 0
    #: Given with --model at start: never evicted.
    pinned: bool = False
    #: The served model's card, where it is loaded and the answer carried it.
    info: ModelInfo | None = None
    #: A LoRA adapter: the model it runs on ("" for a model).
    parent: str = ""

    @classmethod
    def from_proto(
        cls, model: pooling_pb2.RepositoryModel, info: ModelInfo | None = None
    ) -> RepositoryModel:
        return cls(
            name=model.name,
            state=_state(model.state),
            source=model.source,
            memory_bytes=model.memory_bytes,
            reason=model.reason,
            retry_after_s=model.retry_after_s,
            load_seconds=model.load_seconds,
            in_flight=model.in_flight,
            pinned=model.pinned,
            info=info,
            parent=model.parent,
        )


def _state(state: int) -> str:
    if state == pooling_pb2.MODEL_STATE_UNSPECIFIED:
        return ""
    return _enum_suffix(pooling_pb2.ModelState, state, "MODEL_STATE_")


def _modalities(card: pooling_pb2.ModelCard) -> list[str]:
    """Short names ("text", "image"); a card without any (a server from before images)
    serves text."""
    names = [
        _enum_suffix(pooling_pb2.Modality, modality, "MODALITY_")
        for modality in card.modalities
        if modality != pooling_pb2.MODALITY_UNSPECIFIED
    ]
    return names or ["text"]


def _multi_vector_settings(card: pooling_pb2.ModelCard) -> dict[str, Any]:
    if not card.HasField("multi_vector"):
        return {}
    settings = card.multi_vector
    return {
        "query_prefix": settings.query_prefix,
        "document_prefix": settings.document_prefix,
        "query_length": settings.query_length,
        "document_length": settings.document_length,
        "query_expansion": settings.query_expansion,
        "attend_to_expansion_tokens": settings.attend_to_expansion_tokens,
        "skiplist_words": list(settings.skiplist_words),
    }


@dataclass
class TokenizeOutput:
    """How the model tokenizes one text; offsets are (start, end) code-point spans."""

    token_ids: list[int]
    tokens: list[str]
    offsets: list[tuple[int, int]]

    @classmethod
    def from_proto(cls, item: pooling_pb2.TokenizedText) -> TokenizeOutput:
        """Convert one TokenizedText."""
        return cls(list(item.token_ids), list(item.tokens), _spans(item.offsets))


def _output_of(response: pooling_pb2.PoolResponse, *cases: str) -> Any:
    """Return the response's output message, checking it is one of ``cases``."""
    case = response.WhichOneof("output")
    if case not in cases:
        raise ValueError(f"PoolResponse carries output {case!r}, expected {' or '.join(cases)}")
    return getattr(response, case)


def _matrix_data(matrix: pooling_pb2.TokenMatrix) -> Any:
    """Reshape a row-major TokenMatrix into (rows, cols)."""
    rows, cols = matrix.rows, matrix.cols
    if matrix.encoding != pooling_pb2.EMBEDDING_ENCODING_UNSPECIFIED:
        encoding = _encodings.name_of(matrix.encoding)
        return _encodings.decode_rows(matrix.data, encoding, rows, cols)
    if rows < 0 or cols < 0 or len(matrix.values) != rows * cols:
        raise ValueError(
            f"TokenMatrix has {len(matrix.values)} values, expected rows*cols = {rows}*{cols}"
        )
    if np is not None:
        return np.fromiter(matrix.values, dtype=np.float32, count=rows * cols).reshape(rows, cols)
    values = list(matrix.values)
    return [values[r * cols : (r + 1) * cols] for r in range(rows)]


def embedding_request_outputs(
    response: pooling_pb2.PoolResponse,
) -> list[EmbeddingRequestOutput]:
    """One EmbeddingRequestOutput per embedded text."""
    rid = response.request_id
    output = _output_of(response, "embed")
    if output.chunked:  # late chunking: one list of chunks per text
        return [
            EmbeddingRequestOutput(
                f"{rid}-{i}",
                ChunkedEmbeddingOutput(
                    [(chunk.span.start, chunk.span.end) for chunk in text.chunks],
                    [_embedding(chunk.embedding) for chunk in text.chunks],
                ),
            )
            for i, text in enumerate(output.chunked)
        ]
    return [
        EmbeddingRequestOutput(f"{rid}-{i}", _embedding(embedding))
        for i, embedding in enumerate(output.embeddings)
    ]


def _embedding(embedding: pooling_pb2.Embedding) -> EmbeddingOutput:
    modality = _modality(embedding.modality)
    if embedding.encoding == pooling_pb2.EMBEDDING_ENCODING_UNSPECIFIED:
        return EmbeddingOutput(list(embedding.values), modality=modality)
    encoding = _encodings.name_of(embedding.encoding)
    values = _encodings.decode_list(embedding.data, encoding, embedding.dimensions)
    return EmbeddingOutput(values, encoding, embedding.dimensions, embedding.data, modality)


def _modality(value: int) -> str:
    """A result's modality's short name; unset (a text model's answer) is "text"."""
    if value == pooling_pb2.MODALITY_UNSPECIFIED:
        return "text"
    return _enum_suffix(pooling_pb2.Modality, value, "MODALITY_")


def classification_request_outputs(
    response: pooling_pb2.PoolResponse,
) -> list[ClassificationRequestOutput]:
    """One ClassificationRequestOutput per classified text."""
    rid = response.request_id
    output = _output_of(response, "classify")
    return [
        ClassificationRequestOutput(
            f"{rid}-{i}",
            ClassificationOutput(
                list(item.probs), item.label_id, item.label, _modality(item.modality)
            ),
        )
        for i, item in enumerate(output.classifications)
    ]


def scoring_request_outputs(response: pooling_pb2.PoolResponse) -> list[ScoringRequestOutput]:
    """One ScoringRequestOutput per scored pair."""
    rid = response.request_id
    output = _output_of(response, "score")
    return [
        ScoringRequestOutput(f"{rid}-{i}", ScoringOutput(score))
        for i, score in enumerate(output.scores)
    ]


def pooling_request_outputs(response: pooling_pb2.PoolResponse) -> list[PoolingRequestOutput]:
    """One PoolingRequestOutput per text of a token_embed or token_classify response."""
    rid = response.request_id
    output = _output_of(response, "token_embed", "token_classify")
    return [
        PoolingRequestOutput(
            f"{rid}-{i}",
            PoolingOutput(
                data=_matrix_data(matrix),
                token_ids=list(matrix.token_ids),
                offsets=_spans(matrix.offsets),
                special_tokens_mask=list(matrix.special_tokens_mask),
                label_ids=list(matrix.label_ids),
                labels=list(matrix.labels),
                encoding=_encodings.NAMES.get(matrix.encoding),
            ),
        )
        for i, matrix in enumerate(output.items)
    ]


def multi_vector_request_outputs(
    response: pooling_pb2.PoolResponse,
) -> list[PoolingRequestOutput]:
    """One PoolingRequestOutput per text of an embed_multi response: ``data`` is the text's
    (rows, dim) matrix of normalised token vectors (numpy when installed; float32 unless the
    request named an encoding), as token_embed's rows are."""
    rid = response.request_id
    output = _output_of(response, "embed_multi")
    results = []
    for i, matrix in enumerate(output.items):
        encoding = _encodings.name_of(matrix.encoding)
        data = _encodings.decode_rows(matrix.data, encoding, matrix.rows, matrix.cols)
        results.append(PoolingRequestOutput(f"{rid}-{i}", PoolingOutput(data, encoding=encoding)))
    return results


@dataclass
class TextOutputs:
    """One text's outputs of a multi-output (bge-m3) model: those asked for, others None.
    ``dense`` as embed's vector (a list), ``sparse`` as embed_sparse's weights, ``multi``
    as embed_multi's (rows, dim) matrix (numpy when installed)."""

    dense: list[float] | None = None
    sparse: SparseEmbeddingOutput | None = None
    multi: Any = None


@dataclass
class TextOutputsRequestOutput:
    """The outputs of one input text (embed_outputs)."""

    request_id: str
    outputs: TextOutputs


def outputs_request_outputs(
    response: pooling_pb2.PoolResponse,
) -> list[TextOutputsRequestOutput]:
    """One TextOutputsRequestOutput per text of an embed_outputs response."""
    rid = response.request_id
    results = []
    for i, item in enumerate(_output_of(response, "embed_outputs").items):
        found = TextOutputs()
        if item.HasField("dense"):
            found.dense = _embedding(item.dense).embedding
        if item.HasField("sparse"):
            found.sparse = SparseEmbeddingOutput(
                list(item.sparse.indices), list(item.sparse.values), list(item.sparse.tokens)
            )
        if item.HasField("multi"):
            matrix = item.multi
            encoding = _encodings.name_of(matrix.encoding)
            found.multi = _encodings.decode_rows(matrix.data, encoding, matrix.rows, matrix.cols)
        results.append(TextOutputsRequestOutput(f"{rid}-{i}", found))
    return results


def sparse_embedding_request_outputs(
    response: pooling_pb2.PoolResponse,
) -> list[SparseEmbeddingRequestOutput]:
    """One SparseEmbeddingRequestOutput per text of an embed_sparse response."""
    rid = response.request_id
    output = _output_of(response, "embed_sparse")
    results = []
    for i, item in enumerate(output.embeddings):
        count = len(item.indices)
        if len(item.values) != count or len(item.tokens) not in (0, count):
            raise ValueError(
                f"SparseEmbedding {i} has {count} indices, {len(item.values)} values and "
                f"{len(item.tokens)} tokens"
            )
        sparse = SparseEmbeddingOutput(list(item.indices), list(item.values), list(item.tokens))
        results.append(SparseEmbeddingRequestOutput(f"{rid}-{i}", sparse))
    return results


def rerank_request_output(
    response: pooling_pb2.RerankResponse, documents: int, top_n: int
) -> RerankRequestOutput:
    """Convert a RerankResponse to a request of ``documents`` documents, checking it holds
    min(top_n, documents) distinct indices in range (top_n 0: every document)."""
    expected = min(top_n, documents) if top_n > 0 else documents
    results = [
        RerankOutput(
            item.index,
            item.relevance_score,
            item.document if item.HasField("document") else None,
        )
        for item in response.results
    ]
    indices = {result.index for result in results}
    if len(results) != expected or len(indices) != expected or not indices <= set(range(documents)):
        raise ValueError(
            f"RerankResponse {response.request_id!r} does not rank {expected} distinct "
            f"documents of {documents}: indices {[result.index for result in results]}"
        )
    return RerankRequestOutput(
        response.request_id, response.model, results, Usage.from_proto(response.usage)
    )


#: The server's timing trailers (milliseconds), by ServerTiming field.
TIMING_TRAILERS = {
    "total_ms": "x-total-time-ms",
    "tokenization_ms": "x-tokenization-time-ms",
    "queue_ms": "x-queue-time-ms",
    "inference_ms": "x-inference-time-ms",
}


@dataclass
class ServerTiming:
    """Where one request's time went on the server, in milliseconds (its ``x-*-time-ms``
    trailers, as TEI's response headers): tokenizing, waiting in the batch queue, and the
    forward passes; ``total_ms`` spans the whole request."""

    total_ms: float
    tokenization_ms: float
    queue_ms: float
    inference_ms: float

    @classmethod
    def from_metadata(cls, metadata: Iterable[Any] | None) -> ServerTiming | None:
        """Read the trailers of a call; None when the server sent none of them."""
        values: dict[str, str] = {}
        for item in metadata or ():
            key, value = item
            values[key] = value.decode() if isinstance(value, bytes) else value
        try:
            return cls(**{name: float(values[key]) for name, key in TIMING_TRAILERS.items()})
        except (KeyError, ValueError):
            return None


_Output = TypeVar("_Output")


class PoolingResults(list[_Output]):
    """One call's outputs in input order (a list, as vLLM returns), with what the server
    reported: ``usage`` (prompt tokens, summed over the chunks of a streamed call) and
    ``timing`` (the server's timing trailers; None for a call streamed in chunks, which gets
    none). ``numpy()`` stacks the outputs as sentence-transformers' ``convert_to_numpy``."""

    usage: Usage | None
    timing: ServerTiming | None

    def __init__(
        self,
        outputs: Iterable[_Output] = (),
        usage: Usage | None = None,
        timing: ServerTiming | None = None,
    ) -> None:
        super().__init__(outputs)
        self.usage = usage
        self.timing = timing

    def numpy(self) -> Any:
        """Embeddings as one (N, D) array (its dtype the encoding's: float32 by default,
        float16, or int8/uint8 with the bit encodings' packed (N, ceil(D / 8))); token
        outputs as a list of (tokens, D) arrays; classifications as (N, labels); scores as
        (N,). Needs numpy (``pip install 'pooling-client[numpy]'``)."""
        return outputs_numpy(self)


def outputs_numpy(outputs: Sequence[Any]) -> Any:
    """See PoolingResults.numpy."""
    numpy = _encodings.require_numpy()
    if not outputs:
        return numpy.zeros((0, 0), dtype=numpy.float32)
    first = outputs[0].outputs
    if isinstance(first, EmbeddingOutput):
        return _embeddings_numpy([output.outputs for output in outputs])
    if isinstance(first, PoolingOutput):
        return [numpy.asarray(output.outputs.data) for output in outputs]
    if isinstance(first, ClassificationOutput):
        return numpy.array([output.outputs.probs for output in outputs], dtype=numpy.float32)
    if isinstance(first, ScoringOutput):
        return numpy.array([output.outputs.score for output in outputs], dtype=numpy.float32)
    raise TypeError(f"no numpy form for {type(first).__name__}")


def _embeddings_numpy(embeddings: Sequence[EmbeddingOutput]) -> Any:
    numpy = _encodings.require_numpy()
    first = embeddings[0]
    if any(e.encoding != first.encoding or e.hidden_size != first.hidden_size for e in embeddings):
        return numpy.stack([e.numpy() for e in embeddings])
    if first.encoding is None:
        return numpy.array([e.embedding for e in embeddings], dtype=numpy.float32)
    data = b"".join(e.data for e in embeddings)
    return _encodings.decode_array(data, first.encoding, len(embeddings), first.hidden_size)


def model_infos(response: pooling_pb2.ListModelsResponse) -> list[ModelInfo]:
    """One ModelInfo per served model, the default first (server order)."""
    return [ModelInfo.from_proto(card) for card in response.models]


def repository_models(response: pooling_pb2.ListModelsResponse) -> list[RepositoryModel]:
    """Every model the server knows: the served ones (loaded, with their cards), then the
    repository's others (available, loading or failed)."""
    served = [
        RepositoryModel(
            card.name,
            "loaded",
            memory_bytes=card.memory_bytes,
            info=ModelInfo.from_proto(card),
            parent=card.parent,
        )
        for card in response.models
    ]
    return served + [RepositoryModel.from_proto(model) for model in response.repository]


def tokenize_outputs(response: pooling_pb2.TokenizeResponse) -> list[TokenizeOutput]:
    """One TokenizeOutput per input text."""
    return [TokenizeOutput.from_proto(item) for item in response.items]
