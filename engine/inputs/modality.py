"""Inputs that are not text: what a model accepts, and an image or audio clip as the
engine queues it (a Frame).

No torch here: front-end processes build frames and engine processes read them.
"""

from __future__ import annotations

from enum import StrEnum

import numpy as np


class Modality(StrEnum):
    """What an input (and so its result) is: a text, an image or an audio clip."""

    TEXT = "text"
    IMAGE = "image"
    AUDIO = "audio"


class Frame:
    """One preprocessed input that is not a text, on its way to its model's other tower:
    a float32 array as the family's preprocessing left it (an image's pixels [3, H, W], an
    audio clip's samples), and what it costs in a batch (an image's patch count). Which
    modality it is, its model says: a model takes one besides text.

    It stands where a TokenSequence stands in a job's work, so the batching queue, the
    links and the runner need no second kind of item: its length is its cost.
    `input_ids` and `token_type_ids` are empty, so code that gathers ids for a batch or a
    message passes over it.
    """

    __slots__ = ("patches", "pixels")

    input_ids: tuple[int, ...] = ()
    token_type_ids = None

    def __init__(self, pixels: np.ndarray, patches: int) -> None:
        self.pixels = pixels  # the values, whatever the modality (named for images first)
        self.patches = patches  # the cost

    def __len__(self) -> int:
        return self.patches

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.pixels.shape)


def is_image(sequence: object) -> bool:
    """Whether a queued item is a Frame (an image or audio clip), not a token sequence."""
    return type(sequence) is Frame


is_frame = is_image
