"""Audio clips made in the tests: tones and noise as numpy samples, written by soundfile to
the bytes of a WAV, FLAC or OGG file, so every audio test sends real files it built."""

from __future__ import annotations

import io

import numpy as np
import soundfile

SUBTYPES = {"WAV": "PCM_16", "FLAC": "PCM_16", "OGG": "VORBIS"}


def tone(
    seconds: float, rate: int, frequency: float = 440.0, channels: int = 1, seed: int = 0
) -> np.ndarray:
    """A sine with a little noise, float32 [frames, channels]; each channel's phase differs."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    columns = [
        0.4 * np.sin(2 * np.pi * frequency * (1 + 0.25 * c) * t)
        + 0.05 * rng.standard_normal(len(t))
        for c in range(channels)
    ]
    return np.stack(columns, axis=1).astype(np.float32)


def encode(samples: np.ndarray, rate: int, fmt: str = "WAV", subtype: str | None = None) -> bytes:
    """The samples written as a file of `fmt` (WAV, FLAC, OGG, or any libsndfile writes)."""
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate, format=fmt, subtype=subtype or SUBTYPES.get(fmt))
    return buffer.getvalue()


def clip(seconds: float = 0.6, rate: int = 16_000, fmt: str = "WAV", **tone_args: object) -> bytes:
    """A tone's file in one call."""
    return encode(tone(seconds, rate, **tone_args), rate, fmt)  # type: ignore[arg-type]
