"""Pooling methods: token states of a padded batch -> one vector per sequence (a family's
own pooling of logits, SPLADE's, lives in its room)."""

from __future__ import annotations

import numpy as np
import torch

from pooling_server.engine.models.model_info import PoolingType


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
