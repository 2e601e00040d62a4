"""Pooling methods: token states of a padded batch -> one vector per sequence."""

from __future__ import annotations

import torch

from engine.model_info import PoolingType


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
