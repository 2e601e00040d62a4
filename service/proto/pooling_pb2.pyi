from google.rpc import status_pb2 as _status_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PoolingTask(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POOLING_TASK_UNSPECIFIED: _ClassVar[PoolingTask]
    POOLING_TASK_EMBED: _ClassVar[PoolingTask]
    POOLING_TASK_CLASSIFY: _ClassVar[PoolingTask]
    POOLING_TASK_SCORE: _ClassVar[PoolingTask]
    POOLING_TASK_TOKEN_EMBED: _ClassVar[PoolingTask]
    POOLING_TASK_TOKEN_CLASSIFY: _ClassVar[PoolingTask]
    POOLING_TASK_EMBED_SPARSE: _ClassVar[PoolingTask]
    POOLING_TASK_EMBED_MULTI: _ClassVar[PoolingTask]
    POOLING_TASK_EMBED_OUTPUTS: _ClassVar[PoolingTask]

class Modality(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODALITY_UNSPECIFIED: _ClassVar[Modality]
    MODALITY_TEXT: _ClassVar[Modality]
    MODALITY_IMAGE: _ClassVar[Modality]
    MODALITY_AUDIO: _ClassVar[Modality]

class PoolingType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POOLING_TYPE_UNSPECIFIED: _ClassVar[PoolingType]
    POOLING_TYPE_MEAN: _ClassVar[PoolingType]
    POOLING_TYPE_CLS: _ClassVar[PoolingType]
    POOLING_TYPE_LAST: _ClassVar[PoolingType]
    POOLING_TYPE_ALL: _ClassVar[PoolingType]
    POOLING_TYPE_SPLADE: _ClassVar[PoolingType]

class EmbeddingEncoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EMBEDDING_ENCODING_UNSPECIFIED: _ClassVar[EmbeddingEncoding]
    EMBEDDING_ENCODING_FLOAT32: _ClassVar[EmbeddingEncoding]
    EMBEDDING_ENCODING_FLOAT16: _ClassVar[EmbeddingEncoding]
    EMBEDDING_ENCODING_BFLOAT16: _ClassVar[EmbeddingEncoding]
    EMBEDDING_ENCODING_BINARY: _ClassVar[EmbeddingEncoding]
    EMBEDDING_ENCODING_UBINARY: _ClassVar[EmbeddingEncoding]
    EMBEDDING_ENCODING_INT8: _ClassVar[EmbeddingEncoding]
    EMBEDDING_ENCODING_UINT8: _ClassVar[EmbeddingEncoding]

class ChunkRule(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CHUNK_RULE_UNSPECIFIED: _ClassVar[ChunkRule]
    CHUNK_RULE_SENTENCES: _ClassVar[ChunkRule]
    CHUNK_RULE_TOKENS: _ClassVar[ChunkRule]

class ModelState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODEL_STATE_UNSPECIFIED: _ClassVar[ModelState]
    MODEL_STATE_AVAILABLE: _ClassVar[ModelState]
    MODEL_STATE_LOADING: _ClassVar[ModelState]
    MODEL_STATE_LOADED: _ClassVar[ModelState]
    MODEL_STATE_FAILED: _ClassVar[ModelState]
    MODEL_STATE_UNLOADING: _ClassVar[ModelState]
POOLING_TASK_UNSPECIFIED: PoolingTask
POOLING_TASK_EMBED: PoolingTask
POOLING_TASK_CLASSIFY: PoolingTask
POOLING_TASK_SCORE: PoolingTask
POOLING_TASK_TOKEN_EMBED: PoolingTask
POOLING_TASK_TOKEN_CLASSIFY: PoolingTask
POOLING_TASK_EMBED_SPARSE: PoolingTask
POOLING_TASK_EMBED_MULTI: PoolingTask
POOLING_TASK_EMBED_OUTPUTS: PoolingTask
MODALITY_UNSPECIFIED: Modality
MODALITY_TEXT: Modality
MODALITY_IMAGE: Modality
MODALITY_AUDIO: Modality
POOLING_TYPE_UNSPECIFIED: PoolingType
POOLING_TYPE_MEAN: PoolingType
POOLING_TYPE_CLS: PoolingType
POOLING_TYPE_LAST: PoolingType
POOLING_TYPE_ALL: PoolingType
POOLING_TYPE_SPLADE: PoolingType
EMBEDDING_ENCODING_UNSPECIFIED: EmbeddingEncoding
EMBEDDING_ENCODING_FLOAT32: EmbeddingEncoding
EMBEDDING_ENCODING_FLOAT16: EmbeddingEncoding
EMBEDDING_ENCODING_BFLOAT16: EmbeddingEncoding
EMBEDDING_ENCODING_BINARY: EmbeddingEncoding
EMBEDDING_ENCODING_UBINARY: EmbeddingEncoding
EMBEDDING_ENCODING_INT8: EmbeddingEncoding
EMBEDDING_ENCODING_UINT8: EmbeddingEncoding
CHUNK_RULE_UNSPECIFIED: ChunkRule
CHUNK_RULE_SENTENCES: ChunkRule
CHUNK_RULE_TOKENS: ChunkRule
MODEL_STATE_UNSPECIFIED: ModelState
MODEL_STATE_AVAILABLE: ModelState
MODEL_STATE_LOADING: ModelState
MODEL_STATE_LOADED: ModelState
MODEL_STATE_FAILED: ModelState
MODEL_STATE_UNLOADING: ModelState

class PoolingParams(_message.Message):
    __slots__ = ("use_activation", "dimensions", "task", "truncate_prompt_tokens", "output_weights", "adapter", "bypass_cache")
    USE_ACTIVATION_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    BYPASS_CACHE_FIELD_NUMBER: _ClassVar[int]
    use_activation: bool
    dimensions: int
    task: PoolingTask
    truncate_prompt_tokens: int
    output_weights: OutputWeights
    adapter: str
    bypass_cache: bool
    def __init__(self, use_activation: _Optional[bool] = ..., dimensions: _Optional[int] = ..., task: _Optional[_Union[PoolingTask, str]] = ..., truncate_prompt_tokens: _Optional[int] = ..., output_weights: _Optional[_Union[OutputWeights, _Mapping]] = ..., adapter: _Optional[str] = ..., bypass_cache: _Optional[bool] = ...) -> None: ...

class OutputWeights(_message.Message):
    __slots__ = ("dense", "sparse", "multi")
    DENSE_FIELD_NUMBER: _ClassVar[int]
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    MULTI_FIELD_NUMBER: _ClassVar[int]
    dense: float
    sparse: float
    multi: float
    def __init__(self, dense: _Optional[float] = ..., sparse: _Optional[float] = ..., multi: _Optional[float] = ...) -> None: ...

class ImageInput(_message.Message):
    __slots__ = ("data", "mime_type")
    DATA_FIELD_NUMBER: _ClassVar[int]
    MIME_TYPE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    mime_type: str
    def __init__(self, data: _Optional[bytes] = ..., mime_type: _Optional[str] = ...) -> None: ...

class AudioInput(_message.Message):
    __slots__ = ("data", "mime_type")
    DATA_FIELD_NUMBER: _ClassVar[int]
    MIME_TYPE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    mime_type: str
    def __init__(self, data: _Optional[bytes] = ..., mime_type: _Optional[str] = ...) -> None: ...

class Item(_message.Message):
    __slots__ = ("text", "image", "audio")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    text: str
    image: ImageInput
    audio: AudioInput
    def __init__(self, text: _Optional[str] = ..., image: _Optional[_Union[ImageInput, _Mapping]] = ..., audio: _Optional[_Union[AudioInput, _Mapping]] = ...) -> None: ...

class TextInput(_message.Message):
    __slots__ = ("texts", "items", "candidate_labels", "label_template")
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_LABELS_FIELD_NUMBER: _ClassVar[int]
    LABEL_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    texts: _containers.RepeatedScalarFieldContainer[str]
    items: _containers.RepeatedCompositeFieldContainer[Item]
    candidate_labels: _containers.RepeatedScalarFieldContainer[str]
    label_template: str
    def __init__(self, texts: _Optional[_Iterable[str]] = ..., items: _Optional[_Iterable[_Union[Item, _Mapping]]] = ..., candidate_labels: _Optional[_Iterable[str]] = ..., label_template: _Optional[str] = ...) -> None: ...

class OutputsInput(_message.Message):
    __slots__ = ("texts", "dense", "sparse", "multi", "sparse_top_k", "return_tokens")
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    MULTI_FIELD_NUMBER: _ClassVar[int]
    SPARSE_TOP_K_FIELD_NUMBER: _ClassVar[int]
    RETURN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    texts: _containers.RepeatedScalarFieldContainer[str]
    dense: bool
    sparse: bool
    multi: bool
    sparse_top_k: int
    return_tokens: bool
    def __init__(self, texts: _Optional[_Iterable[str]] = ..., dense: _Optional[bool] = ..., sparse: _Optional[bool] = ..., multi: _Optional[bool] = ..., sparse_top_k: _Optional[int] = ..., return_tokens: _Optional[bool] = ...) -> None: ...

class SparseInput(_message.Message):
    __slots__ = ("texts", "top_k", "return_tokens")
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    RETURN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    texts: _containers.RepeatedScalarFieldContainer[str]
    top_k: int
    return_tokens: bool
    def __init__(self, texts: _Optional[_Iterable[str]] = ..., top_k: _Optional[int] = ..., return_tokens: _Optional[bool] = ...) -> None: ...

class ScoreInput(_message.Message):
    __slots__ = ("text_1", "text_2", "items_1", "items_2")
    TEXT_1_FIELD_NUMBER: _ClassVar[int]
    TEXT_2_FIELD_NUMBER: _ClassVar[int]
    ITEMS_1_FIELD_NUMBER: _ClassVar[int]
    ITEMS_2_FIELD_NUMBER: _ClassVar[int]
    text_1: _containers.RepeatedScalarFieldContainer[str]
    text_2: _containers.RepeatedScalarFieldContainer[str]
    items_1: _containers.RepeatedCompositeFieldContainer[Item]
    items_2: _containers.RepeatedCompositeFieldContainer[Item]
    def __init__(self, text_1: _Optional[_Iterable[str]] = ..., text_2: _Optional[_Iterable[str]] = ..., items_1: _Optional[_Iterable[_Union[Item, _Mapping]]] = ..., items_2: _Optional[_Iterable[_Union[Item, _Mapping]]] = ...) -> None: ...

class LateChunking(_message.Message):
    __slots__ = ("spans", "rule", "window_tokens", "overlap_tokens")
    SPANS_FIELD_NUMBER: _ClassVar[int]
    RULE_FIELD_NUMBER: _ClassVar[int]
    WINDOW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    spans: _containers.RepeatedCompositeFieldContainer[TokenSpan]
    rule: ChunkRule
    window_tokens: int
    overlap_tokens: int
    def __init__(self, spans: _Optional[_Iterable[_Union[TokenSpan, _Mapping]]] = ..., rule: _Optional[_Union[ChunkRule, str]] = ..., window_tokens: _Optional[int] = ..., overlap_tokens: _Optional[int] = ...) -> None: ...

class PoolRequest(_message.Message):
    __slots__ = ("request_id", "model", "params", "embed", "classify", "score", "token_embed", "token_classify", "embed_sparse", "embed_multi", "embed_outputs", "prompt_name", "prompt", "encoding", "late_chunking")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    EMBED_FIELD_NUMBER: _ClassVar[int]
    CLASSIFY_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_EMBED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_CLASSIFY_FIELD_NUMBER: _ClassVar[int]
    EMBED_SPARSE_FIELD_NUMBER: _ClassVar[int]
    EMBED_MULTI_FIELD_NUMBER: _ClassVar[int]
    EMBED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_NAME_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    LATE_CHUNKING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    params: PoolingParams
    embed: TextInput
    classify: TextInput
    score: ScoreInput
    token_embed: TextInput
    token_classify: TextInput
    embed_sparse: SparseInput
    embed_multi: TextInput
    embed_outputs: OutputsInput
    prompt_name: str
    prompt: str
    encoding: EmbeddingEncoding
    late_chunking: LateChunking
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., params: _Optional[_Union[PoolingParams, _Mapping]] = ..., embed: _Optional[_Union[TextInput, _Mapping]] = ..., classify: _Optional[_Union[TextInput, _Mapping]] = ..., score: _Optional[_Union[ScoreInput, _Mapping]] = ..., token_embed: _Optional[_Union[TextInput, _Mapping]] = ..., token_classify: _Optional[_Union[TextInput, _Mapping]] = ..., embed_sparse: _Optional[_Union[SparseInput, _Mapping]] = ..., embed_multi: _Optional[_Union[TextInput, _Mapping]] = ..., embed_outputs: _Optional[_Union[OutputsInput, _Mapping]] = ..., prompt_name: _Optional[str] = ..., prompt: _Optional[str] = ..., encoding: _Optional[_Union[EmbeddingEncoding, str]] = ..., late_chunking: _Optional[_Union[LateChunking, _Mapping]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "total_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    total_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., total_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class Embedding(_message.Message):
    __slots__ = ("values", "data", "dimensions", "encoding", "modality")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    MODALITY_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    data: bytes
    dimensions: int
    encoding: EmbeddingEncoding
    modality: Modality
    def __init__(self, values: _Optional[_Iterable[float]] = ..., data: _Optional[bytes] = ..., dimensions: _Optional[int] = ..., encoding: _Optional[_Union[EmbeddingEncoding, str]] = ..., modality: _Optional[_Union[Modality, str]] = ...) -> None: ...

class EmbedOutput(_message.Message):
    __slots__ = ("embeddings", "chunked")
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    CHUNKED_FIELD_NUMBER: _ClassVar[int]
    embeddings: _containers.RepeatedCompositeFieldContainer[Embedding]
    chunked: _containers.RepeatedCompositeFieldContainer[ChunkedText]
    def __init__(self, embeddings: _Optional[_Iterable[_Union[Embedding, _Mapping]]] = ..., chunked: _Optional[_Iterable[_Union[ChunkedText, _Mapping]]] = ...) -> None: ...

class ChunkedText(_message.Message):
    __slots__ = ("chunks",)
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[EmbeddedChunk]
    def __init__(self, chunks: _Optional[_Iterable[_Union[EmbeddedChunk, _Mapping]]] = ...) -> None: ...

class EmbeddedChunk(_message.Message):
    __slots__ = ("span", "embedding")
    SPAN_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    span: TokenSpan
    embedding: Embedding
    def __init__(self, span: _Optional[_Union[TokenSpan, _Mapping]] = ..., embedding: _Optional[_Union[Embedding, _Mapping]] = ...) -> None: ...

class Classification(_message.Message):
    __slots__ = ("probs", "label_id", "label", "modality")
    PROBS_FIELD_NUMBER: _ClassVar[int]
    LABEL_ID_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    MODALITY_FIELD_NUMBER: _ClassVar[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    label_id: int
    label: str
    modality: Modality
    def __init__(self, probs: _Optional[_Iterable[float]] = ..., label_id: _Optional[int] = ..., label: _Optional[str] = ..., modality: _Optional[_Union[Modality, str]] = ...) -> None: ...

class ClassifyOutput(_message.Message):
    __slots__ = ("classifications",)
    CLASSIFICATIONS_FIELD_NUMBER: _ClassVar[int]
    classifications: _containers.RepeatedCompositeFieldContainer[Classification]
    def __init__(self, classifications: _Optional[_Iterable[_Union[Classification, _Mapping]]] = ...) -> None: ...

class ScoreOutput(_message.Message):
    __slots__ = ("scores",)
    SCORES_FIELD_NUMBER: _ClassVar[int]
    scores: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, scores: _Optional[_Iterable[float]] = ...) -> None: ...

class TokenSpan(_message.Message):
    __slots__ = ("start", "end")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    start: int
    end: int
    def __init__(self, start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class TokenMatrix(_message.Message):
    __slots__ = ("rows", "cols", "values", "token_ids", "offsets", "special_tokens_mask", "label_ids", "labels", "data", "encoding")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    COLS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_TOKENS_MASK_FIELD_NUMBER: _ClassVar[int]
    LABEL_IDS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    rows: int
    cols: int
    values: _containers.RepeatedScalarFieldContainer[float]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    offsets: _containers.RepeatedCompositeFieldContainer[TokenSpan]
    special_tokens_mask: _containers.RepeatedScalarFieldContainer[bool]
    label_ids: _containers.RepeatedScalarFieldContainer[int]
    labels: _containers.RepeatedScalarFieldContainer[str]
    data: bytes
    encoding: EmbeddingEncoding
    def __init__(self, rows: _Optional[int] = ..., cols: _Optional[int] = ..., values: _Optional[_Iterable[float]] = ..., token_ids: _Optional[_Iterable[int]] = ..., offsets: _Optional[_Iterable[_Union[TokenSpan, _Mapping]]] = ..., special_tokens_mask: _Optional[_Iterable[bool]] = ..., label_ids: _Optional[_Iterable[int]] = ..., labels: _Optional[_Iterable[str]] = ..., data: _Optional[bytes] = ..., encoding: _Optional[_Union[EmbeddingEncoding, str]] = ...) -> None: ...

class TokenEmbedOutput(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[TokenMatrix]
    def __init__(self, items: _Optional[_Iterable[_Union[TokenMatrix, _Mapping]]] = ...) -> None: ...

class TokenClassifyOutput(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[TokenMatrix]
    def __init__(self, items: _Optional[_Iterable[_Union[TokenMatrix, _Mapping]]] = ...) -> None: ...

class SparseEmbedding(_message.Message):
    __slots__ = ("indices", "values", "tokens")
    INDICES_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    indices: _containers.RepeatedScalarFieldContainer[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    tokens: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, indices: _Optional[_Iterable[int]] = ..., values: _Optional[_Iterable[float]] = ..., tokens: _Optional[_Iterable[str]] = ...) -> None: ...

class SparseEmbedOutput(_message.Message):
    __slots__ = ("embeddings",)
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    embeddings: _containers.RepeatedCompositeFieldContainer[SparseEmbedding]
    def __init__(self, embeddings: _Optional[_Iterable[_Union[SparseEmbedding, _Mapping]]] = ...) -> None: ...

class MultiVectorMatrix(_message.Message):
    __slots__ = ("rows", "cols", "data", "encoding")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    COLS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    rows: int
    cols: int
    data: bytes
    encoding: EmbeddingEncoding
    def __init__(self, rows: _Optional[int] = ..., cols: _Optional[int] = ..., data: _Optional[bytes] = ..., encoding: _Optional[_Union[EmbeddingEncoding, str]] = ...) -> None: ...

class EmbedMultiOutput(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[MultiVectorMatrix]
    def __init__(self, items: _Optional[_Iterable[_Union[MultiVectorMatrix, _Mapping]]] = ...) -> None: ...

class TextOutputs(_message.Message):
    __slots__ = ("dense", "sparse", "multi")
    DENSE_FIELD_NUMBER: _ClassVar[int]
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    MULTI_FIELD_NUMBER: _ClassVar[int]
    dense: Embedding
    sparse: SparseEmbedding
    multi: MultiVectorMatrix
    def __init__(self, dense: _Optional[_Union[Embedding, _Mapping]] = ..., sparse: _Optional[_Union[SparseEmbedding, _Mapping]] = ..., multi: _Optional[_Union[MultiVectorMatrix, _Mapping]] = ...) -> None: ...

class EmbedOutputsOutput(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[TextOutputs]
    def __init__(self, items: _Optional[_Iterable[_Union[TextOutputs, _Mapping]]] = ...) -> None: ...

class PoolResponse(_message.Message):
    __slots__ = ("request_id", "model", "usage", "embed", "classify", "score", "token_embed", "token_classify", "embed_sparse", "embed_multi", "embed_outputs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    EMBED_FIELD_NUMBER: _ClassVar[int]
    CLASSIFY_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_EMBED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_CLASSIFY_FIELD_NUMBER: _ClassVar[int]
    EMBED_SPARSE_FIELD_NUMBER: _ClassVar[int]
    EMBED_MULTI_FIELD_NUMBER: _ClassVar[int]
    EMBED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    usage: Usage
    embed: EmbedOutput
    classify: ClassifyOutput
    score: ScoreOutput
    token_embed: TokenEmbedOutput
    token_classify: TokenClassifyOutput
    embed_sparse: SparseEmbedOutput
    embed_multi: EmbedMultiOutput
    embed_outputs: EmbedOutputsOutput
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., embed: _Optional[_Union[EmbedOutput, _Mapping]] = ..., classify: _Optional[_Union[ClassifyOutput, _Mapping]] = ..., score: _Optional[_Union[ScoreOutput, _Mapping]] = ..., token_embed: _Optional[_Union[TokenEmbedOutput, _Mapping]] = ..., token_classify: _Optional[_Union[TokenClassifyOutput, _Mapping]] = ..., embed_sparse: _Optional[_Union[SparseEmbedOutput, _Mapping]] = ..., embed_multi: _Optional[_Union[EmbedMultiOutput, _Mapping]] = ..., embed_outputs: _Optional[_Union[EmbedOutputsOutput, _Mapping]] = ...) -> None: ...

class PoolStreamRequest(_message.Message):
    __slots__ = ("request",)
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    request: PoolRequest
    def __init__(self, request: _Optional[_Union[PoolRequest, _Mapping]] = ...) -> None: ...

class PoolStreamResponse(_message.Message):
    __slots__ = ("request_id", "response", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    response: PoolResponse
    error: _status_pb2.Status
    def __init__(self, request_id: _Optional[str] = ..., response: _Optional[_Union[PoolResponse, _Mapping]] = ..., error: _Optional[_Union[_status_pb2.Status, _Mapping]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelCard(_message.Message):
    __slots__ = ("name", "tasks", "hidden_size", "max_input_tokens", "is_matryoshka", "matryoshka_dimensions", "labels", "pooling_type", "default_use_activation", "is_default", "architecture", "truncation_side", "long_input", "prompts", "default_prompt_name", "dtype", "device", "revision", "has_calibration_ranges", "backend", "precision", "backend_file", "engines_per_device", "calibration_source", "score_template_source", "multi_vector", "modalities", "image_size", "outputs", "state", "memory_bytes", "parent")
    class PromptsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IS_MATRYOSHKA_FIELD_NUMBER: _ClassVar[int]
    MATRYOSHKA_DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    POOLING_TYPE_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_USE_ACTIVATION_FIELD_NUMBER: _ClassVar[int]
    IS_DEFAULT_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    TRUNCATION_SIDE_FIELD_NUMBER: _ClassVar[int]
    LONG_INPUT_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_PROMPT_NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    HAS_CALIBRATION_RANGES_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FILE_FIELD_NUMBER: _ClassVar[int]
    ENGINES_PER_DEVICE_FIELD_NUMBER: _ClassVar[int]
    CALIBRATION_SOURCE_FIELD_NUMBER: _ClassVar[int]
    SCORE_TEMPLATE_SOURCE_FIELD_NUMBER: _ClassVar[int]
    MULTI_VECTOR_FIELD_NUMBER: _ClassVar[int]
    MODALITIES_FIELD_NUMBER: _ClassVar[int]
    IMAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    name: str
    tasks: _containers.RepeatedScalarFieldContainer[PoolingTask]
    hidden_size: int
    max_input_tokens: int
    is_matryoshka: bool
    matryoshka_dimensions: _containers.RepeatedScalarFieldContainer[int]
    labels: _containers.RepeatedScalarFieldContainer[str]
    pooling_type: PoolingType
    default_use_activation: bool
    is_default: bool
    architecture: str
    truncation_side: str
    long_input: str
    prompts: _containers.ScalarMap[str, str]
    default_prompt_name: str
    dtype: str
    device: str
    revision: str
    has_calibration_ranges: bool
    backend: str
    precision: str
    backend_file: str
    engines_per_device: int
    calibration_source: str
    score_template_source: str
    multi_vector: MultiVectorSettings
    modalities: _containers.RepeatedScalarFieldContainer[Modality]
    image_size: int
    outputs: _containers.RepeatedScalarFieldContainer[str]
    state: ModelState
    memory_bytes: int
    parent: str
    def __init__(self, name: _Optional[str] = ..., tasks: _Optional[_Iterable[_Union[PoolingTask, str]]] = ..., hidden_size: _Optional[int] = ..., max_input_tokens: _Optional[int] = ..., is_matryoshka: _Optional[bool] = ..., matryoshka_dimensions: _Optional[_Iterable[int]] = ..., labels: _Optional[_Iterable[str]] = ..., pooling_type: _Optional[_Union[PoolingType, str]] = ..., default_use_activation: _Optional[bool] = ..., is_default: _Optional[bool] = ..., architecture: _Optional[str] = ..., truncation_side: _Optional[str] = ..., long_input: _Optional[str] = ..., prompts: _Optional[_Mapping[str, str]] = ..., default_prompt_name: _Optional[str] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., revision: _Optional[str] = ..., has_calibration_ranges: _Optional[bool] = ..., backend: _Optional[str] = ..., precision: _Optional[str] = ..., backend_file: _Optional[str] = ..., engines_per_device: _Optional[int] = ..., calibration_source: _Optional[str] = ..., score_template_source: _Optional[str] = ..., multi_vector: _Optional[_Union[MultiVectorSettings, _Mapping]] = ..., modalities: _Optional[_Iterable[_Union[Modality, str]]] = ..., image_size: _Optional[int] = ..., outputs: _Optional[_Iterable[str]] = ..., state: _Optional[_Union[ModelState, str]] = ..., memory_bytes: _Optional[int] = ..., parent: _Optional[str] = ...) -> None: ...

class MultiVectorSettings(_message.Message):
    __slots__ = ("query_prefix", "document_prefix", "query_length", "document_length", "query_expansion", "attend_to_expansion_tokens", "skiplist_words")
    QUERY_PREFIX_FIELD_NUMBER: _ClassVar[int]
    DOCUMENT_PREFIX_FIELD_NUMBER: _ClassVar[int]
    QUERY_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DOCUMENT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    QUERY_EXPANSION_FIELD_NUMBER: _ClassVar[int]
    ATTEND_TO_EXPANSION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SKIPLIST_WORDS_FIELD_NUMBER: _ClassVar[int]
    query_prefix: str
    document_prefix: str
    query_length: int
    document_length: int
    query_expansion: bool
    attend_to_expansion_tokens: bool
    skiplist_words: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, query_prefix: _Optional[str] = ..., document_prefix: _Optional[str] = ..., query_length: _Optional[int] = ..., document_length: _Optional[int] = ..., query_expansion: _Optional[bool] = ..., attend_to_expansion_tokens: _Optional[bool] = ..., skiplist_words: _Optional[_Iterable[str]] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models", "max_client_batch_size", "max_stream_inflight", "server_version", "repository")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    MAX_CLIENT_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_STREAM_INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    REPOSITORY_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelCard]
    max_client_batch_size: int
    max_stream_inflight: int
    server_version: str
    repository: _containers.RepeatedCompositeFieldContainer[RepositoryModel]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelCard, _Mapping]]] = ..., max_client_batch_size: _Optional[int] = ..., max_stream_inflight: _Optional[int] = ..., server_version: _Optional[str] = ..., repository: _Optional[_Iterable[_Union[RepositoryModel, _Mapping]]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("model", "texts", "add_special_tokens")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model: str
    texts: _containers.RepeatedScalarFieldContainer[str]
    add_special_tokens: bool
    def __init__(self, model: _Optional[str] = ..., texts: _Optional[_Iterable[str]] = ..., add_special_tokens: _Optional[bool] = ...) -> None: ...

class TokenizedText(_message.Message):
    __slots__ = ("token_ids", "tokens", "offsets")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[str]
    offsets: _containers.RepeatedCompositeFieldContainer[TokenSpan]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[str]] = ..., offsets: _Optional[_Iterable[_Union[TokenSpan, _Mapping]]] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("model", "items", "max_input_tokens")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    MAX_INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model: str
    items: _containers.RepeatedCompositeFieldContainer[TokenizedText]
    max_input_tokens: int
    def __init__(self, model: _Optional[str] = ..., items: _Optional[_Iterable[_Union[TokenizedText, _Mapping]]] = ..., max_input_tokens: _Optional[int] = ...) -> None: ...

class RerankRequest(_message.Message):
    __slots__ = ("request_id", "model", "query", "documents", "top_n", "return_documents", "params", "instruction", "items")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    TOP_N_FIELD_NUMBER: _ClassVar[int]
    RETURN_DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    INSTRUCTION_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    query: str
    documents: _containers.RepeatedScalarFieldContainer[str]
    top_n: int
    return_documents: bool
    params: PoolingParams
    instruction: str
    items: _containers.RepeatedCompositeFieldContainer[Item]
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., query: _Optional[str] = ..., documents: _Optional[_Iterable[str]] = ..., top_n: _Optional[int] = ..., return_documents: _Optional[bool] = ..., params: _Optional[_Union[PoolingParams, _Mapping]] = ..., instruction: _Optional[str] = ..., items: _Optional[_Iterable[_Union[Item, _Mapping]]] = ...) -> None: ...

class RerankResult(_message.Message):
    __slots__ = ("index", "relevance_score", "document", "modality")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    RELEVANCE_SCORE_FIELD_NUMBER: _ClassVar[int]
    DOCUMENT_FIELD_NUMBER: _ClassVar[int]
    MODALITY_FIELD_NUMBER: _ClassVar[int]
    index: int
    relevance_score: float
    document: str
    modality: Modality
    def __init__(self, index: _Optional[int] = ..., relevance_score: _Optional[float] = ..., document: _Optional[str] = ..., modality: _Optional[_Union[Modality, str]] = ...) -> None: ...

class RerankResponse(_message.Message):
    __slots__ = ("request_id", "model", "results", "usage")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    results: _containers.RepeatedCompositeFieldContainer[RerankResult]
    usage: Usage
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., results: _Optional[_Iterable[_Union[RerankResult, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class RepositoryModel(_message.Message):
    __slots__ = ("name", "state", "source", "memory_bytes", "reason", "load_seconds", "in_flight", "pinned", "retry_after_s", "parent")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    name: str
    state: ModelState
    source: str
    memory_bytes: int
    reason: str
    load_seconds: float
    in_flight: int
    pinned: bool
    retry_after_s: float
    parent: str
    def __init__(self, name: _Optional[str] = ..., state: _Optional[_Union[ModelState, str]] = ..., source: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., reason: _Optional[str] = ..., load_seconds: _Optional[float] = ..., in_flight: _Optional[int] = ..., pinned: _Optional[bool] = ..., retry_after_s: _Optional[float] = ..., parent: _Optional[str] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ("name", "source", "options")
    class OptionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    name: str
    source: str
    options: _containers.ScalarMap[str, str]
    def __init__(self, name: _Optional[str] = ..., source: _Optional[str] = ..., options: _Optional[_Mapping[str, str]] = ...) -> None: ...

class LoadResponse(_message.Message):
    __slots__ = ("model", "card")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CARD_FIELD_NUMBER: _ClassVar[int]
    model: RepositoryModel
    card: ModelCard
    def __init__(self, model: _Optional[_Union[RepositoryModel, _Mapping]] = ..., card: _Optional[_Union[ModelCard, _Mapping]] = ...) -> None: ...

class UnloadRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadResponse(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: RepositoryModel
    def __init__(self, model: _Optional[_Union[RepositoryModel, _Mapping]] = ...) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[RepositoryModel]
    def __init__(self, models: _Optional[_Iterable[_Union[RepositoryModel, _Mapping]]] = ...) -> None: ...
