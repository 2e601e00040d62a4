"""Images: preprocessing a decoded picture to the pixel arrays a vision tower reads, as the
model's own image processor would (decoding the bytes within bounds is image_decoding.py's,
the strip-wise RGB planes image_planes.py's).

Front ends run this (on intake threads, never on an event loop) and hold neither torch nor
transformers, so the processor's steps are done here with Pillow and numpy, read from the
folder's `preprocessor_config.json`; tests/engine/test_image_decoding.py checks the output
against transformers' own processor on the same images.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image as PILImage

from pooling_server.engine.inputs.image_planes import rgb_planes
from pooling_server.engine.inputs.modality import Frame

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

    def frame(self, image: PILImage.Image, transpose: PILImage.Transpose | None = None) -> Frame:
        """One image as the engine queues it: [3, H, W], costing the tower's positions."""
        return Frame(self.one(image, transpose=transpose), self.patches)

    def blank(self) -> Frame:
        """A frame of zeros, the shape of every frame (a warm-up's)."""
        return Frame(np.zeros((3, *self.size), np.float32), self.patches)

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
        planes = rgb_planes(image, transpose, resized, self.resample, self.crop)
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

    def frame(self, image: PILImage.Image, transpose: PILImage.Transpose | None = None) -> Frame:
        pixels = self.one(image, transpose)
        return Frame(pixels, pixels.shape[0] * pixels.shape[1])

    def blank(self) -> Frame:
        rows, cols = self.grid(1, 1)
        pixels = np.zeros((rows, cols, 3 * self.patch * self.patch), np.float32)
        return Frame(pixels, rows * cols)

    def target(self, height: int, width: int) -> tuple[int, int]:
        """The (height, width) the resize gives an upright image of this size."""
        rows, cols = self.grid(height, width)
        return rows * self.patch, cols * self.patch

    def one(self, image: PILImage.Image, transpose: PILImage.Transpose | None = None) -> np.ndarray:
        """float32 [rows, cols, patch * patch * 3]: each patch's pixels row by row, each
        pixel's three channels together."""
        planes = rgb_planes(image, transpose, self.target, self.resample, None)
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
