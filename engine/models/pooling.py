"""Pooling methods: token states (or masked-LM logits) of a padded batch -> one vector per
sequence."""

from __future__ import annotations

import numpy as np
import torch

from pooling_server.engine.models.model_info import PoolingType, SpladeActivation, SpladeStrategy


def pool(hidden: torch.Tensor, mask: torch.Tensor, method: PoolingType) -> torch.Tensor:
    """`hidden` is (batch, tokens, width), `mask` is (batch, tokens) with 1 on real tokens."""
    if method is PoolingType.MEAN:
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
    if method is PoolingType.CLS:
        return hidden[:, 0]
    if method is PoolingType.LAST:
        # The last real token, whichever side the padding is on.
        positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
        last = torch.where(mask.bool(), positions, -1).max(dim=1).values
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    raise ValueError(f"{method} pooling gives one vector per token, not per sequence")


def pool_array(hidden: np.ndarray, mask: np.ndarray, method: PoolingType) -> np.ndarray:
    """`pool` for a backend's output, in numpy: the same few ops in torch start its
    intra-op threads for every batch, which wait for a core on a busy machine (on the
    loop-bound benchmark's model, more time than the backend's forward itself)."""
    if method is PoolingType.MEAN:
        weights = mask[..., None].astype(hidden.dtype)
        return (hidden * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1e-9)
    if method is PoolingType.CLS:
        return hidden[:, 0]
    if method is PoolingType.LAST:
        positions = np.where(mask.astype(bool), np.arange(mask.shape[1]), -1)
        return hidden[np.arange(hidden.shape[0]), positions.max(axis=1)]
    raise ValueError(f"{method} pooling gives one vector per token, not per sequence")


def splade(
    logits: torch.Tensor,
    mask: torch.Tensor,
    strategy: SpladeStrategy,
    activation: SpladeActivation,
) -> torch.Tensor:
    """SPLADE pooling of masked-LM `logits` (batch, tokens, vocab) into (batch, vocab), in place.

    Max: max over real tokens of relu(logits), *before* the log saturation. log1p is
    monotonic, so max then saturate (`heads.saturate`, per request, which lets
    use_activation=false skip it) equals sentence-transformers' saturate then max. Sum: the
    saturation does not commute with a sum, so the weights come back saturated, as
    SpladePooling computes them. Padding weighs 0, as in SpladePooling (weights are >= 0).
    """
    weights = logits.masked_fill_(mask.unsqueeze(-1) == 0, 0).relu_()
    if strategy is SpladeStrategy.MAX:
        return weights.amax(dim=1).float()
    weights = weights.float().log1p_()
    if activation is SpladeActivation.LOG1P_RELU:
        weights = weights.log1p_()
    return weights.sum(dim=1)
