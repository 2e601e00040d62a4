"""Images: decoding the bytes a request carries, within bounds, and preprocessing them to
the pixel arrays a vision tower reads, as the model's own image processor would.

Front ends run this (on intake threads, never on an event loop) and hold neither torch nor
transformers, so the processor's steps are done here with Pillow and numpy, read from the
folder's `preprocessor_config.json`; tests/engine/test_image_decoding.py checks the output
against transformers' own processor on the same images.

Decoding refuses before it spends: bytes over the limit before opening, and a header that
claims more pixels than the limit before the pixels are decoded (a decompression bomb costs
a header read). Formats: PNG, JPEG, WebP and GIF (its first frame).
"""

from __future__ import annotations

import io
import json
import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from PIL import Image as PILImage
from PIL import UnidentifiedImageError

from pooling_server.engine.errors import FieldViolation, PoolingError
from pooling_server.engine.inputs.modality import PixelFrame

if TYPE_CHECKING:
    from pooling_server.engine.requests.validation import Limits


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


def _refuse(path: str, reason: str, description: str) -> PoolingError:
    return PoolingError.invalid([FieldViolation(path, description, reason)])


def _other_format(data: bytes) -> str | None:
    """The name of an image format Pillow knows but we do not serve (for the message)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with PILImage.open(io.BytesIO(data)) as image:  # header only
                return image.format
    except Exception:  # anything unreadable is simply not a format Pillow knows
        return None


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
    if len(data) > limits.max_image_bytes:
        raise _refuse(
            path,
            "IMAGE_TOO_LARGE",
            f"the image has {len(data)} bytes, more than {limits.max_image_bytes} "
            "(--max-image-bytes)",
        )
    if not data:
        raise _refuse(path, "IMAGE_INVALID", "the image is empty")
    declared = _declared_format(image.mime_type, path)
    found = sniff(data)
    if found is None:
        other = _other_format(data)
        if other is not None:
            raise _refuse(
                path,
                "IMAGE_FORMAT_UNSUPPORTED",
                f"{other} images are not supported; send {SUPPORTED}",
            )
        raise _refuse(path, "IMAGE_INVALID", f"the data is not an image ({SUPPORTED})")
    if declared is not None and declared != found:
        raise _refuse(
            path,
            "IMAGE_INVALID",
            f"mime_type {image.mime_type} does not match the data, which is {found}",
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Pillow's bomb warning: the limit below rules
            opened = PILImage.open(io.BytesIO(data), formats=[found])
    except PILImage.DecompressionBombError as error:
        raise _too_many_pixels(path, None, limits) from error
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as error:
        raise _refuse(path, "IMAGE_INVALID", f"the {found} data does not decode") from error
    width, height = opened.size
    if width * height > limits.max_image_pixels or width <= 0 or height <= 0:
        opened.close()
        if width <= 0 or height <= 0:
            raise _refuse(path, "IMAGE_INVALID", "the image has no pixels")
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
        raise _refuse(path, "IMAGE_INVALID", f"the {found} data is corrupt or truncated") from error
    return Opened(opened, ORIENTATIONS.get(orientation))


def _declared_format(mime_type: str, path: str) -> str | None:
    """The format a mime type names; None for none given (the bytes then decide)."""
    mime = mime_type.partition(";")[0].strip().lower()
    if not mime:
        return None
    if mime in MIME_FORMATS:
        return MIME_FORMATS[mime]
    if mime.startswith("image/"):
        raise _refuse(
            path,
            "IMAGE_FORMAT_UNSUPPORTED",
            f"{clip_mime(mime)} is not supported; send {SUPPORTED}",
        )
    raise _refuse(path, "IMAGE_INVALID", f"{clip_mime(mime)} is not an image mime type")


def clip_mime(mime: str) -> str:
    return mime if len(mime) <= 64 else f"{mime[:61]}..."


def _too_many_pixels(path: str, size: tuple[int, int] | None, limits: Limits) -> PoolingError:
    # None: Pillow's own bomb check refused it first (over twice its MAX_IMAGE_PIXELS).
    claimed = (
        f"more than {2 * (PILImage.MAX_IMAGE_PIXELS or 0)}"
        if size is None
        else f"{size[0]}x{size[1]} = {size[0] * size[1]}"
    )
    return _refuse(
        path,
        "IMAGE_TOO_LARGE",
        f"the image has {claimed} pixels, more than {limits.max_image_pixels} (--max-image-pixels)",
    )


def _target_too_large(
    path: str, size: tuple[int, int], target: tuple[int, int], limits: Limits
) -> PoolingError:
    width, height = size
    ratio = max(width, height) / min(width, height)
    return _refuse(
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


GREY = frozenset({"1", "L", "LA", "La", "I", "I;16", "I;16B", "I;16L", "I;16N", "F"})
WIDE = frozenset({"I", "I;16", "I;16B", "I;16L", "I;16N"})
STRIP_PIXELS = 1 << 18  # a strip of rows is converted and resized at a time
# The colour channels are resized across together while their three planes (as wide as
# the target, as tall as the image, then the target) fit this; beyond it (a very tall
# image) one channel at a time, each converting its strips again.
JOINT_BYTES = 8 << 20
WHITE = (255, 255, 255)
# 16-bit grey to 8, as to_rgb makes it: each value // 257, looked up.
SIXTEEN_TO_EIGHT = np.minimum(np.arange(65536) // 257, 255).astype(np.uint8)


def _opaque(strip: PILImage.Image) -> PILImage.Image:
    """to_rgb(strip) (a strip cut from the picture: a crop keeps the palette and the
    transparency), as Pillow operations on the strip: "L" for a grey mode (whose three
    channels are equal), "RGB" otherwise. Transparency goes on white by a paste through its
    alpha, which equals transformers' alpha_composite on white for every value and alpha
    (tests/engine/test_image_decoding.py checks all 65,536 pairs)."""
    keyed = strip.info.get("transparency") is not None
    if strip.mode in WIDE:
        values = np.asarray(strip)  # uint16 for I;16 (either byte order), int32 for I
        if values.dtype.itemsize != 2:
            values = np.clip(values, 0, 65535)  # to_rgb's clip, before the division here
        return PILImage.fromarray(SIXTEEN_TO_EIGHT[values], "L")
    if strip.mode == "F":
        return to_rgb(strip).getchannel(0)
    if "A" in strip.getbands() or keyed:
        rgba = strip if strip.mode == "RGBA" and not keyed else strip.convert("RGBA")
        canvas = PILImage.new("RGB", strip.size, WHITE)
        canvas.paste(rgba, (0, 0), rgba)
        return canvas.getchannel(0) if strip.mode in GREY else canvas
    if strip.mode in GREY:
        return strip if strip.mode == "L" else strip.convert("L")
    return strip if strip.mode == "RGB" else strip.convert("RGB")


def _laid_palette(picture: PILImage.Image) -> bytes | None:
    """For a palette picture with transparency (a GIF's transparent index, a PNG's tRNS):
    its 256 colours as _opaque lays them on white, so that its strips become RGB by a
    palette lookup alone (each pixel's colour depends on its index alone). None for any
    other picture."""
    if picture.mode != "P" or picture.info.get("transparency") is None:
        return None
    probe = picture.crop((0, 0, 256, 1))  # the palette and transparency; each index once:
    probe.putdata(range(256))
    return _opaque(probe).tobytes()


def _upright_rows(
    picture: PILImage.Image,
    transpose: PILImage.Transpose | None,
    top: int,
    bottom: int,
    laid: bytes | None = None,
) -> PILImage.Image:
    """Rows top..bottom of `picture` turned by `transpose` and made as _opaque makes them,
    cut from the part of the picture that becomes them (a turn of a part is that part of
    the turned whole). An upright RGBA or LA picture is laid on white straight from its own
    memory, with no copy of the strip; a palette picture with transparency takes its
    `laid` palette (_laid_palette)."""
    width, height = picture.size
    T = PILImage.Transpose
    if (
        transpose is None
        and picture.mode in ("RGBA", "LA")
        and picture.info.get("transparency") is None
    ):
        canvas = PILImage.new("RGB", (width, bottom - top), WHITE)
        canvas.paste(picture, (0, -top), picture)  # clipped to the canvas: these rows
        return canvas.getchannel(0) if picture.mode == "LA" else canvas
    if transpose in (T.ROTATE_180, T.FLIP_TOP_BOTTOM):
        box = (0, height - bottom, width, height - top)
    elif transpose in (T.ROTATE_270, T.TRANSPOSE):
        box = (top, 0, bottom, height)
    elif transpose in (T.ROTATE_90, T.TRANSVERSE):
        box = (width - bottom, 0, width - top, height)
    else:
        box = (0, top, width, bottom)
    strip = picture.crop(box)
    if transpose is not None:
        strip = strip.transpose(transpose)
    if laid is not None:
        strip.info.pop("transparency", None)
        strip.putpalette(laid, "RGB")
        return strip.convert("RGB")
    return _opaque(strip)


def _planes(
    picture: PILImage.Image,
    transpose: PILImage.Transpose | None,
    resized: Target | None,
    resample: int,
    crop: tuple[int, int] | None,
) -> list[np.ndarray]:
    """The R, G and B planes (uint8 [H, W] each) of `picture` made RGB as to_rgb makes it,
    turned by `transpose`, resized to `resized(height, width)` with `resample`, then
    centre-cropped to `crop`: what the processor computes on the whole RGB picture, pixel
    for pixel, at the cost of a strip of it.

    Pillow resizes each channel alone with the same weights, and in two passes: across
    (each row from its own row) then down. So the picture is made a strip of rows at a
    time: turned, converted once for all its channels (RGBA laid on white, CMYK, 16-bit
    grey, a palette) and resized across, each channel into a plane as wide as the target
    and as tall as the image (one plane for grey, whose three are equal); one pass down
    each finishes it. No RGB copy, compositing canvas or 64-bit intermediate of the whole
    picture exists at once. An RGB picture that is upright and shrinks is resized whole:
    that needs no copy of it."""
    upright = (picture.height, picture.width)
    if transpose in SWAPS:
        upright = upright[::-1]
    height, width = resized(*upright) if resized is not None else upright
    direct = picture.mode == "RGB" and picture.info.get("transparency") is None
    if direct and transpose is None and width * height <= picture.width * picture.height:
        size = (width, height)
        image = picture.resize(size, resample=resample) if size != picture.size else picture
        pixels = _cropped(image, crop)
        return [pixels[..., c] for c in range(3)]
    rows = max(1, STRIP_PIXELS // upright[1])
    grey = picture.mode in GREY
    if grey or 3 * width * (upright[0] + height) <= JOINT_BYTES:
        groups = [range(1 if grey else 3)]
    else:
        groups = [range(c, c + 1) for c in range(3)]
    laid = _laid_palette(picture)
    planes: list[np.ndarray] = []
    for group in groups:
        across = [PILImage.new("L", (width, upright[0])) for _ in group]
        for top in range(0, upright[0], rows):
            bottom = min(upright[0], top + rows)
            band = _upright_rows(picture, transpose, top, bottom, laid)
            if len(across) == 1 and band.mode == "RGB":
                band = band.getchannel(group[0])
            if band.width != width:
                band = band.resize((width, bottom - top), resample=resample)
            channels = band.split() if band.mode == "RGB" else (band,)
            for plane, channel in zip(across, channels, strict=True):
                plane.paste(channel, (0, top))
            del band
        while across:  # each plane down, cropped, and freed before the next
            plane = across.pop(0)
            if plane.height != height:
                plane = plane.resize((width, height), resample=resample)
            planes.append(_cropped(plane, crop))
            del plane
    return planes * 3 if len(planes) == 1 else planes


def _cropped(image: PILImage.Image, crop: tuple[int, int] | None) -> np.ndarray:
    """The image's pixels centre-cropped as transformers crops, taken from Pillow only
    after the crop where it lies inside (a large resize target is never copied whole)."""
    if crop is None:
        return np.asarray(image)
    height, width = crop
    top, left = (image.height - height) // 2, (image.width - width) // 2
    if top >= 0 and left >= 0:
        return np.asarray(image.crop((left, top, left + width, top + height)))
    return _center_crop(np.asarray(image), height, width)


# ------------------------------------------------------------------ preprocessing

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
STANDARD_MEAN = (0.5, 0.5, 0.5)


@dataclass(frozen=True)
class ProcessorDefaults:
    """An image processor class's defaults: what its config may leave out."""

    size: Mapping[str, int]
    crop: bool
    mean: tuple[float, ...]
    std: tuple[float, ...]


# The fixed-resolution processors (the fast variants read the same config).
PROCESSORS: dict[str, ProcessorDefaults] = {
    "CLIPImageProcessor": ProcessorDefaults(
        {"shortest_edge": 224}, True, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
    ),
    "SiglipImageProcessor": ProcessorDefaults(
        {"height": 224, "width": 224}, False, STANDARD_MEAN, STANDARD_MEAN
    ),
}


@dataclass(frozen=True, eq=False)
class ImagePreprocessor:
    """A model's image processor in Pillow and numpy: resize (Pillow, the processor's
    filter), centre crop, rescale and normalize, giving float32 [n, 3, H, W].

    `patches` is an image's cost in a batch: the tower's patch count, plus one where the
    model has a CLS token (CLIP; SigLIP has none)."""

    size: tuple[int, int]  # (height, width) of the output
    patches: int
    resize: Mapping[str, int] | None  # the processor's `size`; None: no resize
    crop: tuple[int, int] | None  # (height, width); None: no crop
    resample: int
    rescale: float | None
    mean: np.ndarray | None  # float32 [3]; None: no normalize
    std: np.ndarray | None

    def __call__(self, images: list[PILImage.Image]) -> np.ndarray:
        out = np.empty((len(images), 3, *self.size), dtype=np.float32)
        for i, image in enumerate(images):
            self.one(image, out[i])
        return out

    def frame(
        self, image: PILImage.Image, transpose: PILImage.Transpose | None = None
    ) -> PixelFrame:
        """One image as the engine queues it: [3, H, W], costing the tower's positions."""
        return PixelFrame(self.one(image, transpose=transpose), self.patches)

    def blank(self) -> PixelFrame:
        """A frame of zeros, the shape of every frame (a warm-up's)."""
        return PixelFrame(np.zeros((3, *self.size), np.float32), self.patches)

    def target(self, height: int, width: int) -> tuple[int, int]:
        """The (height, width) the resize gives an upright image of this size."""
        return self._resized(height, width) if self.resize is not None else (height, width)

    def one(
        self,
        image: PILImage.Image,
        out: np.ndarray | None = None,
        transpose: PILImage.Transpose | None = None,
    ) -> np.ndarray:
        """One image, in any mode, as float32 [3, H, W] (written into `out` when given),
        after turning it by `transpose` (its EXIF orientation)."""
        resized = self._resized if self.resize is not None else None
        planes = _planes(image, transpose, resized, self.resample, self.crop)
        if out is None:
            out = np.empty((3, *planes[0].shape), dtype=np.float32)
        for channel in range(3):  # each uint8 value looked up: rescaled and normalised
            np.take(self.table[channel], planes[channel], out=out[channel])
        return out

    @cached_property
    def table(self) -> np.ndarray:
        """float32 [3, 256]: what rescale then normalize make of each uint8 value, computed
        as transformers computes them (rescale in float64, cast, normalize in float32), so
        a lookup equals the arithmetic on every pixel at a fraction of its cost."""
        return _value_table(self.rescale, self.mean, self.std)

    def _resized(self, height: int, width: int) -> tuple[int, int]:
        """The (height, width) transformers' resize gives for this `size`."""
        size = self.resize or {}
        short_edge = size.get("shortest_edge")
        long_edge = size.get("longest_edge")
        if short_edge and long_edge:
            return _aspect_size(height, width, short_edge, long_edge)
        if short_edge:
            short, long = (width, height) if width <= height else (height, width)
            new_short, new_long = short_edge, int(short_edge * long / short)
            return (new_long, new_short) if width <= height else (new_short, new_long)
        return size["height"], size["width"]


def _value_table(
    rescale: float | None, mean: np.ndarray | None, std: np.ndarray | None
) -> np.ndarray:
    """float32 [3, 256]: each uint8 value rescaled (in float64, then cast) and normalised
    (in float32), as transformers' numpy steps compute it."""
    values: np.ndarray = np.arange(256, dtype=np.uint8)[:, None].repeat(3, axis=1)
    if rescale is not None:
        values = (values.astype(np.float64) * rescale).astype(np.float32)
    else:
        values = values.astype(np.float32)
    if mean is not None and std is not None:
        values = (values - mean) / std
    return np.ascontiguousarray(values.T, dtype=np.float32)


NAFLEX = "Siglip2ImageProcessor"


@dataclass(frozen=True, eq=False)
class NaFlexPreprocessor:
    """SigLIP 2's variable-resolution (NaFlex) processor in Pillow and numpy: each image
    resized, keeping its aspect ratio, to the largest grid of whole patches that fits
    `max_patches`, rescaled, normalised and cut into patches.

    A frame is float32 [rows, cols, patch * patch * 3], the real patches only: its shape
    carries the grid (spatial_shapes) to the engine, which pads a batch and masks the
    padding. Its cost is rows * cols."""

    patch: int
    max_patches: int
    resample: int
    rescale: float | None
    mean: np.ndarray | None  # float32 [3]; None: no normalize
    std: np.ndarray | None

    @property
    def patches(self) -> int:
        """The most an image costs."""
        return self.max_patches

    @property
    def size(self) -> tuple[int, int]:
        """A square image's (height, width): the size a model card names."""
        side = self.grid(1, 1)[0] * self.patch
        return side, side

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """The (rows, cols) of patches an image of this size is resized to: the largest
        scale (found by bisection, as SigLIP 2's processor does) at which each side,
        rounded up to whole patches (at least one), gives at most `max_patches`."""

        def cells(scale: float, side: int) -> int:
            return max(1, math.ceil(side * scale / self.patch))

        low, high = 1e-6, 100.0
        while high - low >= 1e-5:
            middle = (low + high) / 2
            if cells(middle, height) * cells(middle, width) <= self.max_patches:
                low = middle
            else:
                high = middle
        return cells(low, height), cells(low, width)

    def frame(
        self, image: PILImage.Image, transpose: PILImage.Transpose | None = None
    ) -> PixelFrame:
        pixels = self.one(image, transpose)
        return PixelFrame(pixels, pixels.shape[0] * pixels.shape[1])

    def blank(self) -> PixelFrame:
        rows, cols = self.grid(1, 1)
        pixels = np.zeros((rows, cols, 3 * self.patch * self.patch), np.float32)
        return PixelFrame(pixels, rows * cols)

    def target(self, height: int, width: int) -> tuple[int, int]:
        """The (height, width) the resize gives an upright image of this size."""
        rows, cols = self.grid(height, width)
        return rows * self.patch, cols * self.patch

    def one(self, image: PILImage.Image, transpose: PILImage.Transpose | None = None) -> np.ndarray:
        """float32 [rows, cols, patch * patch * 3]: each patch's pixels row by row, each
        pixel's three channels together."""
        planes = _planes(image, transpose, self.target, self.resample, None)
        height, width = planes[0].shape
        p = self.patch
        rows, cols = height // p, width // p
        values = np.empty((height, width, 3), dtype=np.float32)
        for channel in range(3):
            np.take(self.table[channel], planes[channel], out=values[..., channel])
        tiles = values.reshape(rows, p, cols, p, 3).transpose(0, 2, 1, 3, 4)
        return np.ascontiguousarray(tiles.reshape(rows, cols, p * p * 3))

    @cached_property
    def table(self) -> np.ndarray:
        return _value_table(self.rescale, self.mean, self.std)


def _naflex(config: Mapping[str, Any]) -> NaFlexPreprocessor:
    normalize = config.get("do_normalize", True)
    mean = np.asarray(config.get("image_mean", STANDARD_MEAN), dtype=np.float32)
    std = np.asarray(config.get("image_std", STANDARD_MEAN), dtype=np.float32)
    rescale = (
        float(config.get("rescale_factor", 1 / 255)) if config.get("do_rescale", True) else None
    )
    return NaFlexPreprocessor(
        patch=int(config.get("patch_size", 16)),
        max_patches=int(config.get("max_num_patches", 256)),
        resample=int(config.get("resample", PILImage.Resampling.BILINEAR)),
        rescale=rescale,
        mean=mean if normalize else None,
        std=std if normalize else None,
    )


def _aspect_size(height: int, width: int, size: int, max_size: int) -> tuple[int, int]:
    """transformers' get_size_with_aspect_ratio: the short edge to `size`, the long edge
    kept within `max_size`."""
    raw: float | None = None
    low, high = float(min(height, width)), float(max(height, width))
    if high / low * size > max_size:
        raw = max_size * low / high
        size = round(raw)
    if (height <= width and height == size) or (width <= height and width == size):
        return height, width
    if width < height:
        return (int((raw if raw is not None else size) * height / width), size)
    return (size, int((raw if raw is not None else size) * width / height))


def _center_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """transformers' center_crop on [H, W, C] (or [H, W]): an image smaller than the crop
    is padded with zeros around it."""
    h, w = pixels.shape[:2]
    top, left = (h - height) // 2, (w - width) // 2
    if top >= 0 and left >= 0:
        return pixels[top : top + height, left : left + width]
    new_h, new_w = max(height, h), max(width, w)
    padded = np.zeros((new_h, new_w, *pixels.shape[2:]), dtype=pixels.dtype)
    pad_top, pad_left = -(-(new_h - h) // 2), -(-(new_w - w) // 2)
    padded[pad_top : pad_top + h, pad_left : pad_left + w] = pixels
    top, left = top + pad_top, left + pad_left
    return padded[max(0, top) : min(new_h, top + height), max(0, left) : min(new_w, left + width)]


def _size_dict(value: Any, square: bool) -> dict[str, int]:
    """A config's size as transformers' get_size_dict reads it: an int is a square (crops)
    or a shortest edge (CLIP's resize), a pair is (height, width)."""
    if isinstance(value, int):
        return {"height": value, "width": value} if square else {"shortest_edge": value}
    if isinstance(value, (list, tuple)):
        return {"height": int(value[0]), "width": int(value[1])}
    return {key: int(v) for key, v in dict(value).items() if v is not None}


def _processor_settings(folder: Path) -> dict[str, Any] | None:
    """The image processor's settings in `folder`: transformers' preprocessor_config.json,
    or the "image_processor" entry of processor_config.json (what sentence-transformers 6
    saves for a CLIP model)."""
    if (folder / "preprocessor_config.json").is_file():
        return dict(json.loads((folder / "preprocessor_config.json").read_text()))
    if (folder / "processor_config.json").is_file():
        settings = json.loads((folder / "processor_config.json").read_text())
        if isinstance(settings.get("image_processor"), dict):
            return dict(settings["image_processor"])
    return None


def image_model_folder(folder: Path) -> Path | None:
    """The folder holding the image processor: the model's, or for a sentence-transformers
    layout, the module's that has one (clip-ViT-B-32's `0_CLIPModel`)."""
    if _processor_settings(folder) is not None:
        return folder
    modules = folder / "modules.json"
    if modules.is_file():
        for module in json.loads(modules.read_text()):
            path = folder / module.get("path", "")
            if _processor_settings(path) is not None:
                return path
    return None


def load_image_processor(folder: Path) -> ImagePreprocessor | NaFlexPreprocessor | None:
    """The model's image processor from its preprocessor_config.json or processor_config.json
    (and config.json for the patch count); None for a folder without one (a text model).

    Raises ValueError for a processor this server does not reproduce."""
    where = image_model_folder(folder)
    if where is None:
        return None
    config = _processor_settings(where)
    assert config is not None
    kind = str(config.get("image_processor_type", "CLIPImageProcessor")).removesuffix("Fast")
    kind = kind.removesuffix("Pil")
    if kind == NAFLEX:
        return _naflex(config)
    defaults = PROCESSORS.get(kind)
    if defaults is None:
        raise ValueError(
            f"{where}: image processor {kind} is not supported (supported: "
            f"{', '.join([*PROCESSORS, NAFLEX])})"
        )
    resize = _size_dict(config.get("size", defaults.size), square=False)
    if not config.get("do_resize", True):
        resize = {}
    crop: tuple[int, int] | None = None
    if config.get("do_center_crop", defaults.crop):
        crop_dict = _size_dict(config.get("crop_size", {"height": 224, "width": 224}), True)
        crop = (crop_dict["height"], crop_dict["width"])
    if crop is not None:
        out = crop
    elif "height" in resize and "width" in resize:
        out = (resize["height"], resize["width"])
    else:
        raise ValueError(f"{where}: the image processor gives no fixed size (no crop, no height)")
    rescale = (
        float(config.get("rescale_factor", 1 / 255)) if config.get("do_rescale", True) else None
    )
    normalize = config.get("do_normalize", True)
    mean = np.asarray(config.get("image_mean", defaults.mean), dtype=np.float32)
    std = np.asarray(config.get("image_std", defaults.std), dtype=np.float32)
    return ImagePreprocessor(
        size=out,
        patches=_patches(where, out),
        resize=resize or None,
        crop=crop,
        resample=int(config.get("resample", PILImage.Resampling.BICUBIC)),
        rescale=rescale,
        mean=mean if normalize else None,
        std=std if normalize else None,
    )


def _patches(folder: Path, size: tuple[int, int]) -> int:
    """The vision tower's positions for one image: patches, plus CLS for CLIP."""
    path = folder / "config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    vision = config.get("vision_config", config)
    patch = int(vision.get("patch_size", 32))
    model_type = str(config.get("model_type", vision.get("model_type", "clip")))
    cls = 0 if model_type.startswith("siglip") else 1
    return (size[0] // patch) * (size[1] // patch) + cls
