"""SPLADE's own facts (ModelInfo.settings of its models): how token weights pool into one
vocabulary vector, as sentence-transformers' SpladePooling states it, and the saturation
the plan applies per request. Torch-free: front ends read them to validate and plan."""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import numpy as np


class SpladeStrategy(StrEnum):
    """How SPLADE pools token weights (sentence-transformers' SpladePooling.pooling_strategy)."""

    MAX = "max"  # SPLADE v2 and later
    SUM = "sum"  # the original SPLADE


class SpladeActivation(StrEnum):
    """SpladePooling.activation_function: relu, then log1p once (relu) or twice (log1p_relu)."""

    RELU = "relu"
    LOG1P_RELU = "log1p_relu"


@dataclass(frozen=True)
class SpladeSettings:
    """A SPLADE model's pooling; the defaults are SPLADE v2's max over relu, which
    --pooling-type splade gives a masked-LM folder without a SpladePooling module."""

    strategy: SpladeStrategy = SpladeStrategy.MAX
    activation: SpladeActivation = SpladeActivation.RELU


def read_splade_pooling(folder: Path) -> SpladeSettings:
    """A SpladePooling module's config (its defaults when the file is absent)."""
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    strategy = config.get("pooling_strategy", "max")
    activation = config.get("activation_function", "relu")
    try:
        return SpladeSettings(SpladeStrategy(strategy), SpladeActivation(activation))
    except ValueError:
        raise ValueError(
            f"{folder}: SpladePooling with pooling_strategy {strategy!r} and "
            f"activation_function {activation!r} is not supported (max or sum; relu or "
            "log1p_relu)"
        ) from None


def saturate(weights: np.ndarray, activation: SpladeActivation) -> np.ndarray:
    """SPLADE's log saturation of relu'd weights: log(1 + w), twice for log1p_relu."""
    weights = np.log1p(weights)
    return np.log1p(weights) if activation is SpladeActivation.LOG1P_RELU else weights
