"""Python client for the pooling gRPC service, mirroring vLLM's ``LLM`` pooling API.

Only speaks the wire protocol (no torch, no model code), so it installs anywhere::

    from pooling_client import PoolingClient, PoolingParams

    client = PoolingClient("127.0.0.1:50051")
    outputs = client.embed(
        ["Hello world", "How are you?"], pooling_params=PoolingParams(use_activation=True)
    )
    outputs[0].outputs.embedding

``classify``, ``score``, ``encode`` (token_embed / token_classify), ``embed_sparse``,
``rerank``, ``models`` and ``tokenize`` work the same way; :class:`AsyncPoolingClient` offers
them as coroutines. Failed calls raise :class:`PoolingError`, whose ``reason`` and
``field_violations`` say what to fix.
"""

from pooling_client.async_client import AsyncPoolingClient
from pooling_client.client import PoolingClient
from pooling_client.errors import FieldViolation, PoolingError
from pooling_client.outputs import (
    ChunkedEmbeddingOutput,
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    ModelInfo,
    PoolingOutput,
    PoolingRequestOutput,
    PoolingResults,
    RepositoryModel,
    RerankOutput,
    RerankRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
    ServerTiming,
    SparseEmbeddingOutput,
    SparseEmbeddingRequestOutput,
    TextOutputs,
    TextOutputsRequestOutput,
    TokenizeOutput,
    Usage,
)
from pooling_client.params import LateChunking, OutputWeights, PoolingParams

__all__ = [
    "AsyncPoolingClient",
    "ChunkedEmbeddingOutput",
    "ClassificationOutput",
    "ClassificationRequestOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "FieldViolation",
    "LateChunking",
    "ModelInfo",
    "OutputWeights",
    "PoolingClient",
    "PoolingError",
    "PoolingOutput",
    "PoolingParams",
    "PoolingRequestOutput",
    "PoolingResults",
    "RepositoryModel",
    "RerankOutput",
    "RerankRequestOutput",
    "ScoringOutput",
    "ScoringRequestOutput",
    "ServerTiming",
    "SparseEmbeddingOutput",
    "SparseEmbeddingRequestOutput",
    "TextOutputs",
    "TextOutputsRequestOutput",
    "TokenizeOutput",
    "Usage",
]
