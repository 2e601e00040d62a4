"""Images and audio clips as client inputs: bytes, a file (pathlib.Path or another
os.PathLike) or a PIL image become the wire's Item.image, or Item.audio for a WAV, FLAC or
OGG file (told by its first bytes, as the server tells them); a str is always a text.

Pillow is not a dependency: a PIL image is recognised by duck typing (its ``save``), and
encoded as PNG, losslessly, so the server sees exactly its pixels.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterable
from typing import Any

from pooling_client.v1 import pooling_pb2

#: A file's suffix -> the mime type sent with its bytes (others: the server sniffs).
MIME_TYPES = {
    ".png": "image/png",
    ".jpg": "image/jpeg",
    ".jpeg": "image/jpeg",
    ".webp": "image/webp",
    ".gif": "image/gif",
}
#: An audio file's suffix -> its mime type.
AUDIO_MIME_TYPES = {
    ".wav": "audio/wav",
    ".flac": "audio/flac",
    ".ogg": "audio/ogg",
    ".oga": "audio/ogg",
    ".opus": "audio/ogg",
}


def is_audio_bytes(data: bytes) -> bool:
    """Whether the bytes begin as a WAV, FLAC or OGG file (the formats a CLAP model takes)."""
    head = bytes(data[:12])
    return (head[:4] in (b"RIFF", b"RIFX") and head[8:12] == b"WAVE") or head[:4] in (
        b"fLaC",
        b"OggS",
    )


#: One input of an image-text model: a text, or an image in any accepted form.
ImageLike = bytes | bytearray | memoryview | os.PathLike[str] | Any
Input = str | ImageLike


def is_image(value: object) -> bool:
    """Whether ``value`` is an image input (anything but a str that the client takes)."""
    if isinstance(value, (bytes, bytearray, memoryview, os.PathLike)):
        return True
    return callable(getattr(value, "save", None)) and hasattr(value, "mode")


def audio_input(value: Any) -> pooling_pb2.AudioInput | None:
    """``value`` as the wire's AudioInput when it is an audio clip (bytes that begin as WAV,
    FLAC or OGG, or a file with such a suffix); None for anything else."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        return pooling_pb2.AudioInput(data=data) if is_audio_bytes(data) else None
    if isinstance(value, os.PathLike):
        path = os.fspath(value)
        mime = AUDIO_MIME_TYPES.get(os.path.splitext(path)[1].lower())
        if mime is None:
            return None
        with open(path, "rb") as file:
            return pooling_pb2.AudioInput(data=file.read(), mime_type=mime)
    return None


def image_input(value: Any, name: str) -> pooling_pb2.ImageInput:
    """``value`` as the wire's ImageInput (raises TypeError for what is not an image)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return pooling_pb2.ImageInput(data=bytes(value))
    if isinstance(value, os.PathLike):
        path = os.fspath(value)
        with open(path, "rb") as file:
            data = file.read()
        mime = MIME_TYPES.get(os.path.splitext(path)[1].lower(), "")
        return pooling_pb2.ImageInput(data=data, mime_type=mime)
    if is_image(value):  # a PIL image
        out = io.BytesIO()
        value.save(out, format="PNG")
        return pooling_pb2.ImageInput(data=out.getvalue(), mime_type="image/png")
    raise TypeError(
        f"{name} must be a str (a text), an image (bytes, pathlib.Path, PIL image) or an "
        "audio clip (WAV, FLAC or OGG bytes or file), "
        f"got {type(value).__name__}"
    )


def as_inputs(prompts: Input | Iterable[Input], name: str = "prompts") -> list[Any]:
    """One input or a sequence of them as a list: texts stay str; if any is an image, every
    input becomes an Item (the request then sends items, not texts)."""
    single = isinstance(prompts, str) or is_image(prompts)
    values = [prompts] if single else list(prompts)  # type: ignore[arg-type]
    if not any(is_image(v) for v in values):
        for i, text in enumerate(values):
            if not isinstance(text, str):
                raise TypeError(f"{name}[{i}] must be a str, got {type(text).__name__}")
        return values
    return [as_item(v, f"{name}[{i}]") for i, v in enumerate(values)]


def as_item(value: Any, name: str) -> pooling_pb2.Item:
    if isinstance(value, pooling_pb2.Item):
        return value
    if isinstance(value, str):
        return pooling_pb2.Item(text=value)
    audio = audio_input(value)
    if audio is not None:
        return pooling_pb2.Item(audio=audio)
    return pooling_pb2.Item(image=image_input(value, name))


def has_items(values: list[Any]) -> bool:
    return bool(values) and isinstance(values[0], pooling_pb2.Item)


def as_items(values: list[Any]) -> list[pooling_pb2.Item]:
    """Texts or items as items (score's other side, once one side holds an image)."""
    return [as_item(v, "input") for v in values]
