"""A decoded picture made into the RGB planes a vision tower's processor computes: made
RGB as transformers' convert_to_rgb makes it, turned upright, resized and centre-cropped,
a strip of rows at a time, so that no RGB copy of a large picture is ever held whole
(images.py's preprocessors normalise the planes)."""

from __future__ import annotations

import numpy as np
from PIL import Image as PILImage

from pooling_server.engine.inputs.image_decoding import SWAPS, Target, to_rgb

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


def rgb_planes(
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
        pixels = cropped(image, crop)
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
            planes.append(cropped(plane, crop))
            del plane
    return planes * 3 if len(planes) == 1 else planes


def cropped(image: PILImage.Image, crop: tuple[int, int] | None) -> np.ndarray:
    """The image's pixels centre-cropped as transformers crops, taken from Pillow only
    after the crop where it lies inside (a large resize target is never copied whole)."""
    if crop is None:
        return np.asarray(image)
    height, width = crop
    top, left = (image.height - height) // 2, (image.width - width) // 2
    if top >= 0 and left >= 0:
        return np.asarray(image.crop((left, top, left + width, top + height)))
    return center_crop(np.asarray(image), height, width)


def center_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
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
