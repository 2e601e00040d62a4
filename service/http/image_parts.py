"""Images in HTTP bodies (content parts, Cohere's image strings, TEI's zero-shot input)
read into the engine's Image of still-encoded bytes.

The door only base64-decodes: the pixels are decoded and bounded by the engine's intake
(engine/inputs/images.py), off the event loop. No URL is ever fetched: a remote one is refused
(IMAGE_URL_NOT_ALLOWED) naming the rule, so a request cannot make this server reach out
to another host, or wait on one.
"""

from __future__ import annotations

import base64
import binascii
import re

from pooling_server.engine.errors import FieldViolation, PoolingError
from pooling_server.engine.requests.request import Image

URL_RULE = "no URL is fetched; send a data URL (data:image/png;base64,...) or base64"
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


def _base64(text: str, path: str) -> bytes:
    raw = text.encode("ascii", "ignore") if text.isascii() else b"!"
    raw = raw.replace(b"\n", b"").replace(b"\r", b"").replace(b" ", b"")
    if not _BASE64_CHARS.match(raw):
        raise refuse(path, "the image is not base64 (nor a data URL)", "IMAGE_INVALID")
    try:
        if b"-" in raw or b"_" in raw:
            return base64.urlsafe_b64decode(raw + b"=" * (-len(raw) % 4))
        return base64.b64decode(raw + b"=" * (-len(raw) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise refuse(path, "the image's base64 does not decode", "IMAGE_INVALID") from None
