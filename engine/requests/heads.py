"""Heads applied to pooled outputs per item: matryoshka truncation, normalisation, activations."""

from __future__ import annotations

import numpy as np

from pooling_server.engine.models.model_info import Activation


def truncate_dimensions(values: np.ndarray, dimensions: int | None) -> np.ndarray:
    """Matryoshka: keep the leading dimensions (of the last axis)."""
    return values if dimensions is None else values[..., :dimensions]


def normalize(values: np.ndarray) -> np.ndarray:
    """L2-normalise the last axis, as torch.nn.functional.normalize does."""
    norms = np.linalg.norm(values, axis=-1, keepdims=True)
    return values / np.maximum(norms, 1e-12)


def activate(logits: np.ndarray, activation: Activation) -> np.ndarray:
    if activation is Activation.SOFTMAX:
        shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
        return shifted / shifted.sum(axis=-1, keepdims=True)
    if activation is Activation.SIGMOID:
        return 1.0 / (1.0 + np.exp(-logits))
    return logits


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(normalize(a), normalize(b)))
