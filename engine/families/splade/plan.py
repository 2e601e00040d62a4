"""SPLADE's plan: one sparse vocabulary vector per text, its chunks' pooled together."""

from __future__ import annotations

import numpy as np

from pooling_server.engine.families.splade.settings import SpladeSettings, SpladeStrategy, saturate
from pooling_server.engine.models.served import ServedModel
from pooling_server.engine.requests.outputs import SparseEmbedding
from pooling_server.engine.requests.plan_parts import Plan, use_activation
from pooling_server.engine.requests.plans import plan_texts, tokenize_texts
from pooling_server.engine.requests.request import PoolRequest
from pooling_server.engine.requests.resolved import Limits, Resolved


def plan(resolved: Resolved, model: ServedModel, limits: Limits) -> Plan:
    request = resolved.request
    texts = tokenize_texts(resolved, model, limits, request.texts, "embed_sparse.texts")
    return plan_texts(texts, False, lambda text, raws: _sparse(request, model, raws))


def _weights(settings: SpladeSettings, raws: list[np.ndarray]) -> np.ndarray:
    """One chunk: its vocabulary vector. Several: for max pooling their elementwise max (the
    max over every token of the text, each token seen in its own window); for sum pooling
    their sum (each chunk's special tokens counted once per chunk)."""
    if len(raws) == 1:
        return raws[0]
    stacked = np.stack(raws)
    return stacked.max(axis=0) if settings.strategy is SpladeStrategy.MAX else stacked.sum(0)


def _sparse(request: PoolRequest, model: ServedModel, raws: list[np.ndarray]) -> SparseEmbedding:
    """The non-zero weights by decreasing weight (ties by index), the first top_k of them.

    use_activation (default true) is SPLADE's log saturation: false keeps the max over
    tokens of relu(logits) (max pooling only; validation refuses it for sum pooling)."""
    settings: SpladeSettings = model.info.settings
    weights = _weights(settings, raws)
    if settings.strategy is SpladeStrategy.MAX and use_activation(request, True):
        weights = saturate(weights, settings.activation)
    indices = np.flatnonzero(weights)
    order = np.argsort(-weights[indices], kind="stable")
    indices = indices[order[: request.sparse_top_k or None]]
    tokens = model.tokenizer.tokens(indices.tolist()) if request.sparse_tokens else []
    return SparseEmbedding(indices.astype(np.int32), weights[indices].astype(np.float32), tokens)
