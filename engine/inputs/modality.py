"""Inputs that are not text: what a model accepts, and an image as the engine queues it.

No torch here: front-end processes build pixel frames and engine processes read them.
"""

from __future__ import annotations

from enum import StrEnum

import numpy as np


class Modality(StrEnum):
    """What an input (and so its result) is: a text or an image."""

    TEXT = "text"
    IMAGE = "image"


class PixelFrame:
    """One preprocessed image on its way to the image tower: float32 [3, H, W] as the
    model's image processor left it, and what it costs in a batch (its patch count).

    It stands where a TokenSequence stands in a job's work, so the batching queue needs no
    second kind of item: its length is its cost. `input_ids` and `token_type_ids` are
    empty, so code that gathers ids for a batch or a message passes over it.
    """

    __slots__ = ("patches", "pixels")

    input_ids: tuple[int, ...] = ()
    token_type_ids = None

    def __init__(self, pixels: np.ndarray, patches: int) -> None:
        self.pixels = pixels
        self.patches = patches

    def __len__(self) -> int:
        return self.patches

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.pixels.shape)


def is_image(sequence: object) -> bool:
    return type(sequence) is PixelFrame
