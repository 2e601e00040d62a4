"""Encoded media (an image, an audio clip) checked before its decoder opens it, the same
way for every kind: its bytes within their bound, not empty, a supported format by their
signature, and the mime type the client gave agreeing with them. Each refusal is named
for its kind (IMAGE_TOO_LARGE, AUDIO_INVALID, ...), so the errors table answers it as one
of that kind; the header's own bounds (pixels, duration) are the decoder's to check."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from pooling_server.engine.errors import FieldViolation, PoolingError, clip


@dataclass(frozen=True)
class MediaKind:
    """What the checks say of one kind of media, and how they tell its formats apart."""

    noun: str  # "image": "the image is empty", and its mime types' "image/"
    reasons: str  # the prefix of its reasons: IMAGE_TOO_LARGE, IMAGE_INVALID, ...
    flag: str  # the bound on its bytes: "--max-image-bytes"
    mime_formats: Mapping[str, str]  # a mime type a client may send -> its format
    supported: str  # the formats served, as messages list them: "PNG, JPEG, WebP or GIF"
    sniff: Callable[[bytes], str | None]  # the served format the bytes begin as, or None
    # The format the decoder reads the bytes as where it is not served, for the message.
    other_format: Callable[[bytes], str | None]
    unserved: str  # that refusal's words: "{format} images are not supported"
    what: str  # what bytes of no format are not: "an image" ("the data is not an image")


def refuse(path: str, reason: str, description: str) -> PoolingError:
    return PoolingError.invalid([FieldViolation(path, description, reason)])


def check_encoded(kind: MediaKind, data: bytes, mime_type: str, path: str, limit: int) -> str:
    """The format of `data`, checked before anything decodes it.

    Refused (INVALID_ARGUMENT, the violation at `path`): <kind>_TOO_LARGE for more than
    `limit` bytes; <kind>_FORMAT_UNSUPPORTED for a format not served (by the bytes, or by
    the mime type); <kind>_INVALID for no bytes, bytes of no format the decoder knows, a
    mime type of another kind, or one the bytes disagree with."""
    if len(data) > limit:
        raise refuse(
            path,
            f"{kind.reasons}_TOO_LARGE",
            f"the {kind.noun} has {len(data)} bytes, more than {limit} ({kind.flag})",
        )
    invalid, unsupported = f"{kind.reasons}_INVALID", f"{kind.reasons}_FORMAT_UNSUPPORTED"
    if not data:
        raise refuse(path, invalid, f"the {kind.noun} is empty")
    declared = _declared_format(kind, mime_type, path)
    found = kind.sniff(data)
    if found is None:
        other = kind.other_format(data)
        if other is not None:
            served = kind.unserved.format(format=other)
            raise refuse(path, unsupported, f"{served}; send {kind.supported}")
        raise refuse(path, invalid, f"the data is not {kind.what} ({kind.supported})")
    if declared is not None and declared != found:
        raise refuse(
            path,
            invalid,
            f"mime_type {clip_mime(mime_type)} does not match the data, which is {found}",
        )
    return found


def _declared_format(kind: MediaKind, mime_type: str, path: str) -> str | None:
    """The format a mime type names; None for none given (the bytes then decide)."""
    mime = mime_type.partition(";")[0].strip().lower()
    if not mime:
        return None
    if mime in kind.mime_formats:
        return kind.mime_formats[mime]
    if mime.startswith(f"{kind.noun}/"):
        raise refuse(
            path,
            f"{kind.reasons}_FORMAT_UNSUPPORTED",
            f"{clip_mime(mime)} is not supported; send {kind.supported}",
        )
    raise refuse(
        path, f"{kind.reasons}_INVALID", f"{clip_mime(mime)} is not an {kind.noun} mime type"
    )


def clip_mime(mime: str) -> str:
    """A client's mime type as a message echoes it."""
    return clip(mime, 64)
