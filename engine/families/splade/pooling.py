"""SPLADE's pooling of a masked-LM's logits, on the device (the torch side: imported where
models load, by loading.py, which hands it to the runner)."""

from __future__ import annotations

import torch

from pooling_server.engine.families.splade.settings import (
    SpladeActivation,
    SpladeSettings,
    SpladeStrategy,
)


def splade(
    logits: torch.Tensor,
    mask: torch.Tensor,
    strategy: SpladeStrategy,
    activation: SpladeActivation,
) -> torch.Tensor:
    """SPLADE pooling of masked-LM `logits` (batch, tokens, vocab) into (batch, vocab), in place.

    Max: max over real tokens of relu(logits), *before* the log saturation. log1p is
    monotonic, so max then saturate (`settings.saturate`, per request, which lets
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


class SpladePooling:
    """The runner's pooling of a SPLADE model's per-token logits into one vocabulary
    vector per sequence (ModelRunner's `pool_logits`)."""

    def __init__(self, settings: SpladeSettings) -> None:
        self.settings = settings

    def __call__(self, logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return splade(logits, mask, self.settings.strategy, self.settings.activation)
