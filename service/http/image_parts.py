"""Images in HTTP bodies: OpenAI/vLLM content parts and Cohere's image strings, read into
the engine's items (a text, or an Image of still-encoded bytes).

The door only base64-decodes: the pixels are decoded and bounded by the engine's intake
(engine/images.py), off the event loop. No URL is ever fetched: a remote one is refused
(IMAGE_URL_NOT_ALLOWED) naming the rule, so a request cannot make this server reach out
to another host, or wait on one.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Sequence
from typing import Any

import msgspec

from pooling_server.engine.errors import FieldViolation, PoolingError
from pooling_server.engine.request import Image, Item

URL_RULE = "no URL is fetched; send a data URL (data:image/png;base64,...) or base64"
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]{0,31}):")
_BASE64_CHARS = re.compile(rb"^[A-Za-z0-9+/_-]*={0,2}$")


class ImageUrl(msgspec.Struct):
    url: str
    detail: str | None = None  # OpenAI's; nothing to do with embeddings, skipped


class Part(msgspec.Struct):
    """One content part: {"type": "text", "text": ...} or {"type": "image_url",
    "image_url": {"url": ...}} (also a bare string in place of the object), or
    {"type": "image", "image": <data URL or base64>}."""

    type: str
    text: str | None = None
    image_url: ImageUrl | str | None = None
    image: str | None = None


class Message(msgspec.Struct):
    """A chat message as vLLM's embeddings route takes it; its role is not read."""

    content: str | list[Part]
    role: str = "user"


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


def part_image(part: Part, path: str) -> Image | None:
    """The image of an image part; None for a text part; any other type is refused."""
    if part.type == "text":
        if part.text is None:
            raise refuse(f"{path}.text", "a text part needs its text")
        return None
    if part.type in ("image_url", "input_image"):
        given = part.image_url
        url = given.url if isinstance(given, ImageUrl) else given
        if url is None:
            raise refuse(f"{path}.image_url", 'an image_url part needs {"url": ...}')
        return image_from_url(url, f"{path}.image_url")
    if part.type == "image" and part.image is not None:
        return image_from_url(part.image, f"{path}.image")
    raise refuse(
        f"{path}.type",
        f"must be text or image_url, got {part.type[:32]!r}",
    )


def content_item(parts: Sequence[Part], path: str) -> Item:
    """One input from content parts: its text parts joined by newlines, or its one image.
    A text and an image in one input are refused: a two-tower model (CLIP, SigLIP) embeds
    either, never both as one vector; send them as two inputs."""
    if not parts:
        raise refuse(path, "must hold at least one part")
    images = [(k, part_image(p, f"{path}[{k}]")) for k, p in enumerate(parts)]
    found = [(k, image) for k, image in images if image is not None]
    if not found:
        return "\n".join(p.text or "" for p in parts)
    if len(parts) > 1:
        raise refuse(
            path,
            "an input is one text or one image: a two-tower model embeds each alone; "
            "send the image and the text as separate inputs",
            "IMAGE_TEXT_MIXED",
        )
    return found[0][1]


Entry = str | dict[str, Any] | list[Part]  # one input as JSON holds it


def input_item(entry: Entry, path: str) -> Item:
    """One input of a list that may hold images: a text, a content part, a list of parts,
    or vLLM's multimodal score shape {"content": [parts]}."""
    if isinstance(entry, str):
        return entry
    if isinstance(entry, list):
        return content_item(entry, path)
    try:
        if "type" not in entry and isinstance(entry.get("text"), str):
            return entry["text"]  # a rerank document as {"text": ...}
        if "content" in entry and "type" not in entry:
            parts = msgspec.convert(entry["content"], list[Part])
            return content_item(parts, f"{path}.content")
        part = msgspec.convert(entry, Part)
        image = part_image(part, path)
        return part.text or "" if image is None else image
    except msgspec.ValidationError as error:
        raise refuse(path, f"not a text or a content part: {error}") from None


def input_items(value: Entry | list[Entry], path: str) -> list[Item]:
    """A field's inputs: one entry, or a list of them (each one input)."""
    if isinstance(value, list):
        return [input_item(entry, f"{path}[{n}]") for n, entry in enumerate(value)]
    return [input_item(value, path)]


def messages_item(messages: Sequence[Message], path: str = "messages") -> Item:
    """vLLM's `messages` form of /v1/embeddings: the conversation is one input, so its
    parts together make one text or one image."""
    parts: list[Part] = []
    for n, message in enumerate(messages):
        if isinstance(message.content, str):
            parts.append(Part("text", text=message.content))
        elif len(messages) == 1:
            return content_item(message.content, f"{path}[0].content")
        else:
            parts.extend(message.content)
            if any(p.type != "text" for p in message.content):
                raise refuse(
                    f"{path}[{n}].content",
                    "an image must be the only content of a one-message request",
                    "IMAGE_TEXT_MIXED",
                )
    return content_item(parts, path)


def has_image(items: Sequence[Item]) -> bool:
    return any(isinstance(item, Image) for item in items)
