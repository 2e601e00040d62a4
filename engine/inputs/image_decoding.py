"""Images: decoding the bytes a request carries, within bounds. Preprocessing what this
opens into a vision tower's pixels is images.py's.

Decoding refuses before it spends: bytes over the limit before opening, and a header that
claims more pixels than the limit before the pixels are decoded (a decompression bomb costs
a header read). Formats: PNG, JPEG, WebP and GIF (its first frame). Front ends run this on
intake threads, with Pillow and numpy only.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
from PIL import Image as PILImage
from PIL import UnidentifiedImageError

from pooling_server.engine.errors import PoolingError
from pooling_server.engine.inputs.encoded import MediaKind, check_encoded, refuse

if TYPE_CHECKING:
    from pooling_server.engine.requests.resolved import Limits


class EncodedImage(Protocol):
    """An image as a request carries it (engine.request.Image): encoded bytes, and the
    mime type the client gave ("" for none)."""

    @property
    def data(self) -> bytes: ...

    @property
    def mime_type(self) -> str: ...


# Pillow's format name -> the mime types a client may name it by.
FORMATS: dict[str, tuple[str, ...]] = {
    "PNG": ("image/png",),
    "JPEG": ("image/jpeg", "image/jpg", "image/pjpeg"),
    "WEBP": ("image/webp",),
    "GIF": ("image/gif",),
}
MIME_FORMATS = {mime: name for name, mimes in FORMATS.items() for mime in mimes}
SUPPORTED = "PNG, JPEG, WebP or GIF"


def sniff(data: bytes) -> str | None:
    """The supported format the bytes begin as, from their signature; None: none of them."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "GIF"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return None


def _other_format(data: bytes) -> str | None:
    """The name of an image format Pillow knows but we do not serve (for the message)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with PILImage.open(io.BytesIO(data)) as image:  # header only
                return image.format
    except Exception:  # anything unreadable is simply not a format Pillow knows
        return None


IMAGE = MediaKind(
    noun="image",
    reasons="IMAGE",
    flag="--max-image-bytes",
    mime_formats=MIME_FORMATS,
    supported=SUPPORTED,
    sniff=sniff,
    other_format=_other_format,
    unserved="{format} images are not supported",
    what="an image",
)


@dataclass(eq=False)
class Opened:
    """A decoded image as its bytes gave it: its own mode (RGBA, CMYK, 16-bit grey...), and
    the turn its EXIF orientation asks for (None: upright). Preprocessing makes it RGB and
    upright a strip of rows at a time, so a large picture is never held twice at full size."""

    picture: PILImage.Image
    transpose: PILImage.Transpose | None = None

    def close(self) -> None:
        self.picture.close()


# The resize target's (height, width) for an upright (height, width): what the model's
# processor makes of an image, so its cost is bounded before a pixel is decoded.
Target = Callable[[int, int], tuple[int, int]]

ORIENTATIONS = {
    2: PILImage.Transpose.FLIP_LEFT_RIGHT,
    3: PILImage.Transpose.ROTATE_180,
    4: PILImage.Transpose.FLIP_TOP_BOTTOM,
    5: PILImage.Transpose.TRANSPOSE,
    6: PILImage.Transpose.ROTATE_270,
    7: PILImage.Transpose.TRANSVERSE,
    8: PILImage.Transpose.ROTATE_90,
}  # as ImageOps.exif_transpose reads the tag
SWAPS = {
    PILImage.Transpose.TRANSPOSE,
    PILImage.Transpose.ROTATE_270,
    PILImage.Transpose.TRANSVERSE,
    PILImage.Transpose.ROTATE_90,
}


def decode_image(image: EncodedImage, limits: Limits, path: str) -> PILImage.Image:
    """`image` decoded to an RGB picture, upright (EXIF orientation applied), its first frame
    for an animation, transparency laid on white (as transformers' convert_to_rgb does).
    Refused as open_image refuses. This holds the whole picture in RGB besides the decoded
    one: serving goes through open_image and a preprocessor's frame, which do not."""
    opened = open_image(image, limits, path)
    picture = to_rgb(opened.picture)
    if opened.transpose is not None:
        picture = picture.transpose(opened.transpose)
    if picture is not opened.picture:
        opened.close()
    return picture


def open_image(
    image: EncodedImage, limits: Limits, path: str, target: Target | None = None
) -> Opened:
    """`image` decoded (its first frame for an animation) in its own mode, with the EXIF
    turn still to apply.

    Refused (INVALID_ARGUMENT, the violation at `path`): IMAGE_TOO_LARGE for bytes over
    `limits.max_image_bytes`, a header of more than `limits.max_image_pixels` pixels, or
    one whose resize `target` (the model's processor's) would exceed that many pixels (an
    extreme aspect ratio that the shortest-edge resize blows up), all before decoding;
    IMAGE_FORMAT_UNSUPPORTED for a format other than PNG, JPEG, WebP or GIF (by the bytes,
    or by the mime type given), IMAGE_INVALID for bytes that do not decode (corrupt,
    truncated, empty) or a mime type the bytes disagree with."""
    data = image.data
    found = check_encoded(IMAGE, data, image.mime_type, path, limits.max_image_bytes)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Pillow's bomb warning: the limit below rules
            opened = PILImage.open(io.BytesIO(data), formats=[found])
    except PILImage.DecompressionBombError as error:
        raise _too_many_pixels(path, None, limits) from error
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as error:
        raise refuse(path, "IMAGE_INVALID", f"the {found} data does not decode") from error
    width, height = opened.size
    if width * height > limits.max_image_pixels or width <= 0 or height <= 0:
        opened.close()
        if width <= 0 or height <= 0:
            raise refuse(path, "IMAGE_INVALID", "the image has no pixels")
        raise _too_many_pixels(path, (width, height), limits)
    if target is not None:
        # The target's pixel count is the same upright or turned (its sides swap).
        new_height, new_width = target(height, width)
        if new_height * new_width > limits.max_image_pixels:
            opened.close()
            raise _target_too_large(path, (width, height), (new_width, new_height), limits)
    try:
        opened.seek(0)  # an animation's first frame
        opened.load()
        orientation = opened.getexif().get(0x0112, 1)
    except (OSError, ValueError, SyntaxError, EOFError) as error:
        opened.close()
        raise refuse(path, "IMAGE_INVALID", f"the {found} data is corrupt or truncated") from error
    return Opened(opened, ORIENTATIONS.get(orientation))


def _too_many_pixels(path: str, size: tuple[int, int] | None, limits: Limits) -> PoolingError:
    # None: Pillow's own bomb check refused it first (over twice its MAX_IMAGE_PIXELS).
    claimed = (
        f"more than {2 * (PILImage.MAX_IMAGE_PIXELS or 0)}"
        if size is None
        else f"{size[0]}x{size[1]} = {size[0] * size[1]}"
    )
    return refuse(
        path,
        "IMAGE_TOO_LARGE",
        f"the image has {claimed} pixels, more than {limits.max_image_pixels} (--max-image-pixels)",
    )


def _target_too_large(
    path: str, size: tuple[int, int], target: tuple[int, int], limits: Limits
) -> PoolingError:
    width, height = size
    ratio = max(width, height) / min(width, height)
    return refuse(
        path,
        "IMAGE_TOO_LARGE",
        f"the image is {width}x{height} (aspect ratio {ratio:.0f}:1), which the model's "
        f"processor resizes to {target[0]}x{target[1]} = {target[0] * target[1]} pixels, "
        f"more than {limits.max_image_pixels} (--max-image-pixels); crop it nearer to square",
    )


def to_rgb(image: PILImage.Image) -> PILImage.Image:
    """RGB as transformers' convert_to_rgb makes it (transparency composited on white),
    except that 16-bit and 32-bit grey keep their brightness (Pillow's own conversion clips
    every value over 255 to white)."""
    if image.mode == "RGB":
        return image
    if image.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        values = np.asarray(image.convert("I"), dtype=np.int64)  # 16-bit values
        image = PILImage.fromarray(np.clip(values // 257, 0, 255).astype(np.uint8), "L")
    elif image.mode == "F":
        values = np.asarray(image, dtype=np.float32)
        image = PILImage.fromarray(np.clip(values, 0, 255).astype(np.uint8), "L")
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = PILImage.new("RGBA", rgba.size, (255, 255, 255, 255))
        return PILImage.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")
