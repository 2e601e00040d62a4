"""Images and audio clips in HTTP bodies (content parts, Cohere's image strings, TEI's
zero-shot input, OpenAI's input_audio) read into the engine's Image or Audio of
still-encoded bytes.

The door only base64-decodes: the pixels (samples) are decoded and bounded by the engine's
intake (engine/inputs/images.py, engine/families/clap/audio.py), off the event loop. No
URL is ever fetched: a remote one is refused (IMAGE_URL_NOT_ALLOWED, AUDIO_URL_NOT_ALLOWED)
naming the rule, so a request cannot make this server reach out to another host, or wait
on one.
"""

from __future__ import annotations

import base64
import binascii
import re

from pooling_server.engine.errors import FieldViolation, PoolingError
from pooling_server.engine.requests.request import Audio, Image

URL_RULE = "no URL is fetched; send a data URL (data:image/png;base64,...) or base64"
AUDIO_URL_RULE = "no URL is fetched; send the clip's bytes as base64 (or a data URL)"
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]{0,31}):")
_BASE64_CHARS = re.compile(rb"^[A-Za-z0-9+/_-]*={0,2}$")


def refuse(path: str, description: str, reason: str = "INVALID_BODY") -> PoolingError:
    return PoolingError.invalid([FieldViolation(path, description, reason)])


def image_from_url(url: str, path: str) -> Image:
    """A data URL (data:image/...;base64,...) or bare base64, as an Image; any other URL is
    refused (IMAGE_URL_NOT_ALLOWED), and base64 that does not decode is IMAGE_INVALID."""
    url = url.strip()
    mime = ""
    scheme = _SCHEME.match(url[:40])
    if scheme is not None and scheme.group(1).lower() != "data":
        shown = scheme.group(1).lower()
        raise refuse(path, f"a {shown}: URL was given: {URL_RULE}", "IMAGE_URL_NOT_ALLOWED")
    if scheme is not None:  # data:[<mime>][;base64],<data>
        header, comma, payload = url.partition(",")
        if not comma:
            raise refuse(path, "the data URL has no comma before its data", "IMAGE_INVALID")
        params = header[5:].split(";")
        if "base64" not in (p.strip().lower() for p in params[1:]):
            problem = "the data URL must be base64 (data:<mime>;base64,...)"
            raise refuse(path, problem, "IMAGE_INVALID")
        mime = params[0].strip()
        url = payload
    return Image(_base64(url, path), mime)


def audio_from_part(data: str, format_name: str, path: str) -> Audio:
    """OpenAI's input_audio: base64 `data` (or a data URL, data:audio/wav;base64,...) and
    its `format` ("wav", "flac", "ogg"), as an Audio; any other URL is refused
    (AUDIO_URL_NOT_ALLOWED), and base64 that does not decode is AUDIO_INVALID."""
    data = data.strip()
    mime = _audio_mime(format_name)
    scheme = _SCHEME.match(data[:40])
    if scheme is not None and scheme.group(1).lower() != "data":
        shown = scheme.group(1).lower()
        raise refuse(
            f"{path}.data", f"a {shown}: URL was given: {AUDIO_URL_RULE}", "AUDIO_URL_NOT_ALLOWED"
        )
    if scheme is not None:  # data:[<mime>][;base64],<data>
        header, comma, payload = data.partition(",")
        params = header[5:].split(";")
        if not comma or "base64" not in (p.strip().lower() for p in params[1:]):
            problem = "the data URL must be base64 (data:<mime>;base64,...)"
            raise refuse(f"{path}.data", problem, "AUDIO_INVALID")
        mime = mime or params[0].strip()
        data = payload
    return Audio(_base64(data, f"{path}.data", "audio"), mime)


def _audio_mime(format_name: str) -> str:
    """The mime type a format names ("wav" -> audio/wav); "" for none given."""
    name = format_name.strip().lower()
    return f"audio/{name}" if name else ""


def _base64(text: str, path: str, kind: str = "image") -> bytes:
    reason = f"{kind.upper()}_INVALID"
    raw = text.encode("ascii", "ignore") if text.isascii() else b"!"
    raw = raw.replace(b"\n", b"").replace(b"\r", b"").replace(b" ", b"")
    if not _BASE64_CHARS.match(raw):
        raise refuse(path, f"the {kind} is not base64 (nor a data URL)", reason)
    try:
        if b"-" in raw or b"_" in raw:
            return base64.urlsafe_b64decode(raw + b"=" * (-len(raw) % 4))
        return base64.b64decode(raw + b"=" * (-len(raw) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise refuse(path, f"the {kind}'s base64 does not decode", reason) from None
