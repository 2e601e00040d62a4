"""engine/inputs/image_decoding.py, image_planes.py and images.py: every format decodes,
every bad image is refused with its reason and field path (a decompression bomb from its
header alone), awkward modes come out as RGB, and preprocessing equals transformers' own
image processors on the same pictures."""

from __future__ import annotations

import io
import json
import struct
import time
import tracemalloc
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from PIL import Image as PILImage
from PIL import ImageOps
from transformers import (
    CLIPConfig,
    CLIPImageProcessorPil,
    Siglip2ImageProcessorPil,
    SiglipConfig,
    SiglipImageProcessorPil,
)

from pooling_server.engine.errors import PoolingError
from pooling_server.engine.inputs.image_decoding import decode_image, sniff
from pooling_server.engine.inputs.images import load_image_processor
from pooling_server.engine.requests.resolved import Limits

PATH = "embed.items[2].image"
LIMITS = Limits()


@dataclass(frozen=True)
class Encoded:
    data: bytes
    mime_type: str = ""


def picture(width: int = 40, height: int = 30, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def encode(image: PILImage.Image, fmt: str, **options: object) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def refused(image: Encoded, limits: Limits = LIMITS) -> PoolingError:
    with pytest.raises(PoolingError) as caught:
        decode_image(image, limits, PATH)
    error = caught.value
    assert error.kind == "INVALID_ARGUMENT"
    assert [v.field for v in error.violations] == [PATH]
    return error


# ------------------------------------------------------------------ formats


@pytest.mark.parametrize(
    ("fmt", "mime"), [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp")]
)
def test_each_format_decodes_to_rgb(fmt: str, mime: str) -> None:
    pixels = picture()
    lossless = {"lossless": True} if fmt == "WEBP" else {}
    data = encode(PILImage.fromarray(pixels), fmt, **lossless)
    assert sniff(data) == fmt
    for given in ("", mime, mime.upper() + "; charset=binary"):
        decoded = decode_image(Encoded(data, given), LIMITS, PATH)
        assert decoded.mode == "RGB" and decoded.size == (40, 30)
        if fmt != "JPEG":  # lossless: the very pixels
            np.testing.assert_array_equal(np.asarray(decoded), pixels)


def test_gif_gives_its_first_frame() -> None:
    frames = [PILImage.fromarray(np.full((8, 8, 3), v, np.uint8)) for v in (10, 200, 90)]
    data = encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50)
    assert PILImage.open(io.BytesIO(data)).n_frames == 3
    decoded = decode_image(Encoded(data, "image/gif"), LIMITS, PATH)
    assert decoded.mode == "RGB"
    assert np.asarray(decoded).max() <= 12  # the first frame (grey 10), not the others


def test_animated_webp_gives_its_first_frame() -> None:
    frames = [PILImage.fromarray(np.full((8, 8, 3), v, np.uint8)) for v in (30, 220)]
    data = encode(frames[0], "WEBP", save_all=True, append_images=frames[1:], lossless=True)
    decoded = decode_image(Encoded(data), LIMITS, PATH)
    assert np.asarray(decoded).max() == 30


# ------------------------------------------------------------------ modes


def test_cmyk_jpeg_becomes_rgb_as_pillow_converts_it() -> None:
    cmyk = PILImage.fromarray(picture(seed=1)).convert("CMYK")
    data = encode(cmyk, "JPEG", quality=95)
    decoded = decode_image(Encoded(data), LIMITS, PATH)
    assert decoded.mode == "RGB"
    expected = np.asarray(PILImage.open(io.BytesIO(data)).convert("RGB"))
    np.testing.assert_array_equal(np.asarray(decoded), expected)


def test_sixteen_bit_grey_keeps_its_brightness() -> None:
    values = np.array([[0, 257, 32896, 65535]], dtype=np.uint16)
    data = encode(PILImage.fromarray(values), "PNG")
    decoded = decode_image(Encoded(data), LIMITS, PATH)
    # Pillow's own RGB conversion clips at 255 (all but the first white): ours scales.
    np.testing.assert_array_equal(np.asarray(decoded)[0, :, 0], [0, 1, 128, 255])


def test_transparency_is_laid_on_white() -> None:
    rgba = np.zeros((4, 4, 4), np.uint8)
    rgba[:2, :, :3] = (10, 20, 30)
    rgba[:2, :, 3] = 255  # the top half opaque, the bottom half fully transparent
    for mode in ("RGBA", "LA"):
        image = PILImage.fromarray(rgba, "RGBA").convert(mode)
        decoded = np.asarray(decode_image(Encoded(encode(image, "PNG")), LIMITS, PATH))
        assert (decoded[2:] == 255).all()
        assert (decoded[:2] < 255).all()


def test_palette_with_a_transparent_index_is_laid_on_white() -> None:
    image = PILImage.new("P", (4, 4), 0)
    image.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    image.paste(1, (0, 0, 2, 4))
    data = encode(image, "PNG", transparency=0)
    decoded = np.asarray(decode_image(Encoded(data), LIMITS, PATH))
    assert (decoded[:, :2] == (255, 0, 0)).all()
    assert (decoded[:, 2:] == 255).all()


def test_exif_orientation_is_applied() -> None:
    pixels = picture(40, 30, seed=2)
    exif = PILImage.Exif()
    exif[0x0112] = 6  # rotated 90 degrees clockwise to view
    data = encode(PILImage.fromarray(pixels), "PNG", exif=exif)
    decoded = decode_image(Encoded(data), LIMITS, PATH)
    assert decoded.size == (30, 40)
    np.testing.assert_array_equal(np.asarray(decoded), np.rot90(pixels, k=-1))


# ------------------------------------------------------------------ refusals


def png_claiming(width: int, height: int) -> bytes:
    """A valid PNG header of this size, followed by a few bytes of pixels."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    pixels = zlib.compress(b"\x00" * 1024)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")
    )


def test_a_decompression_bomb_is_refused_from_its_header() -> None:
    bomb = png_claiming(50_000, 50_000)  # 2.5 gigapixels: 7.5 GB as RGB
    assert len(bomb) < 200
    tracemalloc.start()
    start = time.perf_counter()
    error = refused(Encoded(bomb, "image/png"))
    took = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert error.reason == "IMAGE_TOO_LARGE"
    assert "--max-image-pixels" in error.message
    assert peak < 5 * 1024 * 1024 and took < 1.0
    error = refused(Encoded(png_claiming(10_000, 6_000)))  # under Pillow's own bomb limit
    assert error.reason == "IMAGE_TOO_LARGE" and "10000x6000 = 60000000 pixels" in error.message


def test_pixels_and_bytes_over_their_limits_are_refused() -> None:
    data = encode(PILImage.fromarray(picture(40, 30)), "PNG")
    error = refused(Encoded(data), Limits(max_image_pixels=40 * 30 - 1))
    assert error.reason == "IMAGE_TOO_LARGE"
    decode_image(Encoded(data), Limits(max_image_pixels=40 * 30), PATH)
    error = refused(Encoded(data), Limits(max_image_bytes=len(data) - 1))
    assert error.reason == "IMAGE_TOO_LARGE" and "--max-image-bytes" in error.message


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_truncated_images_are_invalid(fmt: str) -> None:
    data = encode(PILImage.fromarray(picture(64, 64, seed=3)), fmt)
    error = refused(Encoded(data[: len(data) // 2]))
    assert error.reason == "IMAGE_INVALID"


def test_corrupt_and_empty_data_are_invalid() -> None:
    data = bytearray(encode(PILImage.fromarray(picture(64, 64)), "PNG"))
    data[60:200] = bytes(140)  # the compressed pixels wiped
    assert refused(Encoded(bytes(data))).reason == "IMAGE_INVALID"
    assert refused(Encoded(b"\x89PNG\r\n\x1a\n" + b"junk" * 10)).reason == "IMAGE_INVALID"
    assert refused(Encoded(b"plain text, no image")).reason == "IMAGE_INVALID"
    assert refused(Encoded(b"")).reason == "IMAGE_INVALID"


def test_other_formats_are_unsupported() -> None:
    for fmt in ("BMP", "TIFF"):
        data = encode(PILImage.fromarray(picture()), fmt)
        error = refused(Encoded(data))
        assert error.reason == "IMAGE_FORMAT_UNSUPPORTED"
        assert fmt in error.message and "PNG, JPEG, WebP or GIF" in error.message
    png = encode(PILImage.fromarray(picture()), "PNG")
    assert refused(Encoded(png, "image/tiff")).reason == "IMAGE_FORMAT_UNSUPPORTED"


def test_a_mime_type_must_agree_with_the_bytes() -> None:
    png = encode(PILImage.fromarray(picture()), "PNG")
    error = refused(Encoded(png, "image/jpeg"))
    assert error.reason == "IMAGE_INVALID" and "PNG" in error.message
    assert refused(Encoded(png, "text/plain")).reason == "IMAGE_INVALID"


# ------------------------------------------------------------------ preprocessing


def _config_folder(folder: Path, config_class: type, patch: int, processor: object) -> Path:
    """A config (224-pixel images in `patch`-pixel patches, tiny towers) beside the
    processor's settings: all that loading an image processor reads."""
    vision = {"image_size": 224, "patch_size": patch, "hidden_size": 32, "num_attention_heads": 2}
    config_class(
        vision_config=vision, text_config={"hidden_size": 32, "num_attention_heads": 2}
    ).save_pretrained(folder)
    processor.save_pretrained(folder)  # type: ignore[attr-defined]
    return folder


def clip_folder(tmp_path: Path, processor: object) -> Path:
    return _config_folder(tmp_path / "clip", CLIPConfig, 32, processor)


def siglip_folder(tmp_path: Path, processor: object) -> Path:
    return _config_folder(tmp_path / "siglip", SiglipConfig, 16, processor)


SIZES = [(224, 224), (300, 200), (180, 400), (97, 61), (640, 480)]


def _pictures() -> list[PILImage.Image]:
    images = [PILImage.fromarray(picture(w, h, seed=i)) for i, (w, h) in enumerate(SIZES)]
    jpeg = encode(PILImage.fromarray(picture(333, 250, seed=9)), "JPEG")
    return [*images, decode_image(Encoded(jpeg), LIMITS, PATH)]


@pytest.mark.parametrize(
    "processor",
    [
        CLIPImageProcessorPil(),
        CLIPImageProcessorPil(size={"shortest_edge": 160}, crop_size={"height": 128, "width": 96}),
        CLIPImageProcessorPil(resample=2, image_mean=[0.5, 0.4, 0.3], image_std=[0.2, 0.3, 0.4]),
        CLIPImageProcessorPil(size={"shortest_edge": 100}, crop_size={"height": 128, "width": 128}),
        CLIPImageProcessorPil(size={"shortest_edge": 200, "longest_edge": 260}),
    ],
    ids=["default", "other-sizes", "bilinear-other-stats", "crop-pads", "longest-edge"],
)
def test_clip_preprocessing_equals_transformers(tmp_path: Path, processor: object) -> None:
    ours = load_image_processor(clip_folder(tmp_path, processor))
    assert ours is not None
    images = _pictures()
    expected = processor(images, return_tensors="np")["pixel_values"]  # type: ignore[operator]
    got = ours(images)
    assert got.dtype == np.float32 and got.shape == expected.shape
    assert got.shape[2:] == ours.size
    np.testing.assert_array_equal(got, expected)  # bit for bit


@pytest.mark.parametrize(
    "processor",
    [SiglipImageProcessorPil(), SiglipImageProcessorPil(size={"height": 96, "width": 128})],
    ids=["default", "other-size"],
)
def test_siglip_preprocessing_equals_transformers(tmp_path: Path, processor: object) -> None:
    ours = load_image_processor(siglip_folder(tmp_path, processor))
    assert ours is not None
    images = _pictures()
    expected = processor(images, return_tensors="np")["pixel_values"]  # type: ignore[operator]
    np.testing.assert_array_equal(ours(images), expected)


@pytest.mark.parametrize(
    "processor",
    [
        Siglip2ImageProcessorPil(),
        Siglip2ImageProcessorPil(patch_size=4, max_num_patches=16),
        Siglip2ImageProcessorPil(
            patch_size=8, max_num_patches=100, resample=3, image_mean=[0.4, 0.5, 0.6]
        ),
    ],
    ids=["default", "tiny", "bicubic-other-stats"],
)
def test_siglip2_naflex_preprocessing_equals_transformers(
    tmp_path: Path, processor: object
) -> None:
    """SigLIP 2's NaFlex: each image's own patch grid, its patches bit for bit the real
    (unpadded) rows of transformers' pixel_values, its cost the grid's patch count."""
    ours = load_image_processor(siglip_folder(tmp_path, processor))
    assert ours is not None
    images = _pictures()
    expected = processor(images, return_tensors="np")  # type: ignore[operator]
    for k, image in enumerate(images):
        frame = ours.frame(image)  # type: ignore[union-attr]
        rows, cols = (int(n) for n in expected["spatial_shapes"][k])
        assert frame.pixels.shape[:2] == (rows, cols) and len(frame) == rows * cols
        assert int(expected["pixel_attention_mask"][k].sum()) == rows * cols
        real = expected["pixel_values"][k][: rows * cols]
        np.testing.assert_array_equal(frame.pixels.reshape(rows * cols, -1), real)


def test_patch_counts(tmp_path: Path) -> None:
    clip = load_image_processor(clip_folder(tmp_path, CLIPImageProcessorPil()))
    siglip = load_image_processor(siglip_folder(tmp_path, SiglipImageProcessorPil()))
    assert clip is not None and siglip is not None
    assert (clip.size, clip.patches) == ((224, 224), 7 * 7 + 1)  # ViT-B/32 and its CLS
    assert (siglip.size, siglip.patches) == ((224, 224), 14 * 14)  # no CLS


def test_sentence_transformers_layout_and_text_models(tmp_path: Path) -> None:
    inner = clip_folder(tmp_path, CLIPImageProcessorPil())
    root = tmp_path
    modules = [{"idx": 0, "name": "0", "path": inner.name, "type": "CLIPModel"}]
    (root / "modules.json").write_text(json.dumps(modules))
    found = load_image_processor(root)
    assert found is not None and found.patches == 50
    text_only = tmp_path / "text"
    text_only.mkdir()
    assert load_image_processor(text_only) is None


def test_an_unknown_processor_is_named(tmp_path: Path) -> None:
    folder = clip_folder(tmp_path, CLIPImageProcessorPil())
    config = json.loads((folder / "preprocessor_config.json").read_text())
    config["image_processor_type"] = "ViTImageProcessor"
    (folder / "preprocessor_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="ViTImageProcessor"):
        load_image_processor(folder)


# ------------------------------------------------------------------ every mode, bounded


def _mode_pictures() -> dict[str, PILImage.Image]:
    """One picture in each mode a PNG, JPEG or GIF decodes to, odd sizes among them (the
    small ones grow to the resize target), transparency partial and whole."""
    rng = np.random.default_rng(7)
    rgba = rng.integers(0, 256, (45, 70, 4), dtype=np.uint8)
    rgba[:10, :, 3] = 0  # fully transparent rows
    base = PILImage.fromarray(rgba, "RGBA")
    palette = base.convert("RGB").convert("P", palette=PILImage.Palette.ADAPTIVE, colors=60)
    keyed = palette.copy()
    keyed.info["transparency"] = 3
    alphas = palette.copy()  # a PNG's tRNS: an alpha for each index
    alphas.info["transparency"] = bytes(rng.integers(0, 256, 60, dtype=np.uint8))
    tall = PILImage.fromarray(rng.integers(0, 256, (301, 9, 3), dtype=np.uint8))
    keyed_rgb, keyed_grey = base.convert("RGB"), base.convert("L")
    keyed_rgb.info["transparency"] = tuple(rgba[12, 5, :3].tolist())
    keyed_grey.info["transparency"] = int(np.asarray(keyed_grey)[12, 5])
    return {
        "RGB": base.convert("RGB"),
        "RGBA": base,
        "LA": base.convert("LA"),
        "L": base.convert("L"),
        "1": base.convert("1"),
        "P": palette,
        "P-transparent": keyed,
        "P-alphas": alphas,
        "RGB-transparent": keyed_rgb,
        "L-transparent": keyed_grey,
        "PA": base.convert("PA"),
        "CMYK": base.convert("CMYK"),
        "RGB-tall-small": tall,
        "RGBA-wide-small": PILImage.fromarray(rgba[:5], "RGBA"),
    }


PROCESSORS_UNDER_TEST = {
    "clip": (clip_folder, CLIPImageProcessorPil()),
    "clip-longest": (
        clip_folder,
        CLIPImageProcessorPil(size={"shortest_edge": 60, "longest_edge": 90}, resample=2),
    ),
    "siglip": (siglip_folder, SiglipImageProcessorPil(size={"height": 40, "width": 56})),
    "naflex": (siglip_folder, Siglip2ImageProcessorPil(patch_size=4, max_num_patches=64)),
}


def _expected(processor: object, image: PILImage.Image) -> np.ndarray:
    """The processor on the picture as transformers' convert_to_rgb makes it (CLIP's and
    SigLIP's processors call it themselves; SigLIP 2's does not)."""
    from transformers.image_transforms import convert_to_rgb

    out = processor([convert_to_rgb(image)], return_tensors="np")  # type: ignore[operator]
    if "spatial_shapes" in out:  # NaFlex: the real patches, as our frame holds them
        rows, cols = (int(n) for n in out["spatial_shapes"][0])
        return out["pixel_values"][0][: rows * cols].reshape(rows, cols, -1)
    return out["pixel_values"][0]


@pytest.mark.parametrize("joint", [True, False], ids=["channels-together", "one-by-one"])
@pytest.mark.parametrize("kind", list(PROCESSORS_UNDER_TEST))
def test_every_mode_equals_transformers_strip_by_strip(
    tmp_path: Path, kind: str, joint: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each mode made RGB a strip at a time (strips of a few rows here, so every picture
    is many), its channels resized together or (a very tall image's way) one at a time,
    equals transformers' processor on the whole picture, its own convert_to_rgb included:
    bit for bit."""
    import pooling_server.engine.inputs.image_planes as planes

    monkeypatch.setattr(planes, "STRIP_PIXELS", 97)
    if not joint:
        monkeypatch.setattr(planes, "JOINT_BYTES", 0)
    build, processor = PROCESSORS_UNDER_TEST[kind]
    ours = load_image_processor(build(tmp_path, processor))
    assert ours is not None
    for name, image in _mode_pictures().items():
        np.testing.assert_array_equal(ours.one(image), _expected(processor, image), err_msg=name)


@pytest.mark.parametrize("mode", ["RGBA", "LA"])
def test_every_value_and_alpha_is_laid_on_white_as_transformers_lays_it(
    tmp_path: Path, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Transparency goes on white by Pillow's paste through the alpha (one pass for all
    channels), where transformers' convert_to_rgb calls alpha_composite: the two round
    alike for all 65,536 (value, alpha) pairs, laid straight from an upright picture and
    from a turned strip. A size-preserving processor lets every pixel through unblurred."""
    import pooling_server.engine.inputs.image_planes as planes

    monkeypatch.setattr(planes, "STRIP_PIXELS", 256 * 37)  # strips that split the rows
    value, alpha = np.meshgrid(np.arange(256), np.arange(256))
    channels = [value, 255 - value, (value * 7) % 256, alpha]
    pairs = PILImage.fromarray(np.stack(channels, -1).astype(np.uint8), "RGBA").convert(mode)
    processor = SiglipImageProcessorPil(size={"height": 256, "width": 256})
    ours = load_image_processor(siglip_folder(tmp_path, processor))
    assert ours is not None
    np.testing.assert_array_equal(ours.one(pairs), _expected(processor, pairs))
    turn = PILImage.Transpose.ROTATE_90
    np.testing.assert_array_equal(
        ours.one(pairs, transpose=turn), _expected(processor, pairs.transpose(turn))
    )


@pytest.mark.parametrize("orientation", range(2, 9))
def test_every_exif_turn_equals_the_turned_picture(tmp_path: Path, orientation: int) -> None:
    """An EXIF turn applied a strip at a time (RGBA, RGB, LA and a palette with a
    transparent index) equals the processor on the picture that ImageOps.exif_transpose
    turns whole."""
    from pooling_server.engine.inputs.image_decoding import open_image

    processor = CLIPImageProcessorPil(size={"shortest_edge": 40}, crop_size=32)
    ours = load_image_processor(clip_folder(tmp_path, processor))
    assert ours is not None
    exif = PILImage.Exif()
    exif[0x0112] = orientation
    for mode in ("RGBA", "RGB", "LA", "P-transparent"):
        image = _mode_pictures()[mode]
        opened = open_image(Encoded(encode(image, "PNG", exif=exif)), LIMITS, PATH)
        assert opened.transpose is not None
        upright = ImageOps.exif_transpose(
            PILImage.open(io.BytesIO(encode(image, "PNG", exif=exif)))
        )
        got = ours.one(opened.picture, transpose=opened.transpose)
        np.testing.assert_array_equal(got, _expected(processor, upright), err_msg=mode)


def test_sixteen_bit_grey_a_strip_at_a_time_equals_the_whole(tmp_path: Path) -> None:
    """16-bit grey (scaled, not clipped: decode_image's semantics) made a strip at a time
    equals the processor on decode_image's whole RGB picture."""
    from pooling_server.engine.inputs.image_decoding import open_image

    processor = CLIPImageProcessorPil()
    ours = load_image_processor(clip_folder(tmp_path, processor))
    assert ours is not None
    values = np.random.default_rng(3).integers(0, 65536, (90, 130), dtype=np.uint16)
    data = encode(PILImage.fromarray(values), "PNG")
    opened = open_image(Encoded(data), LIMITS, PATH)
    assert opened.picture.mode.startswith("I")
    expected = _expected(processor, decode_image(Encoded(data), LIMITS, PATH))
    np.testing.assert_array_equal(ours.one(opened.picture), expected)


def test_an_extreme_aspect_ratio_is_refused_by_its_resize_target(tmp_path: Path) -> None:
    """CLIP resizes the shortest side to 224 before its crop: a 10000 x 1 PNG of 109 bytes
    would become 2,240,000 x 224 (501 million pixels, 2 GB). The target counts against
    --max-image-pixels before a pixel is decoded: refused at once, naming the aspect ratio
    and the target; the same ratio that fits the limit is served."""
    from pooling_server.engine.inputs.image_decoding import open_image

    ours = load_image_processor(clip_folder(tmp_path, CLIPImageProcessorPil()))
    assert ours is not None
    data = encode(PILImage.new("RGB", (10_000, 1)), "PNG", optimize=True)
    assert len(data) < 200
    start = time.perf_counter()
    with pytest.raises(PoolingError) as caught:
        open_image(Encoded(data), LIMITS, PATH, ours.target)
    took = time.perf_counter() - start
    error = caught.value
    assert [(v.field, v.reason) for v in error.violations] == [(PATH, "IMAGE_TOO_LARGE")]
    assert "aspect ratio 10000:1" in error.message
    assert "2240000x224 = 501760000 pixels" in error.message and took < 1.0
    # Tall, not wide: the same target turned; and a limit the target fits serves it.
    tall = encode(PILImage.new("RGB", (1, 10_000)), "PNG", optimize=True)
    with pytest.raises(PoolingError):
        open_image(Encoded(tall), LIMITS, PATH, ours.target)
    roomy = Limits(max_image_pixels=224 * 2_240_000)
    opened = open_image(Encoded(data), roomy, PATH, ours.target)
    assert ours.one(opened.picture).shape == (3, 224, 224)


MEASURE = r"""
import io, json, sys
from pathlib import Path
import psutil
from pooling_server.engine.inputs.image_decoding import open_image
from pooling_server.engine.inputs.images import load_image_processor
from pooling_server.engine.requests.validation import Limits

class Encoded:
    def __init__(self, data):
        self.data, self.mime_type = data, ""

def peak():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

processor = load_image_processor(Path(sys.argv[1]))
data = Path(sys.argv[2]).read_bytes()
Path("/proc/self/clear_refs").write_text("5")  # the peak starts again from here
before = psutil.Process().memory_info().rss
opened = open_image(Encoded(data), Limits(), "x", processor.target)
decoded = opened.picture.width * opened.picture.height
processor.frame(opened.picture, opened.transpose)
print(json.dumps([(peak() - before) / 1e6, decoded]))
"""

# Bytes a pixel each mode decodes to in Pillow (LA, RGB and CMYK keep four).
DECODED_BYTES = {"RGB": 4, "RGBA": 4, "LA": 4, "I;16": 2, "CMYK": 4, "P": 1, "L": 1}


def _large(mode: str, side: int) -> bytes:
    pixels = np.zeros((side, side, 4), np.uint8)
    pixels[:64, :64] = np.random.default_rng(0).integers(0, 256, (64, 64, 4))
    image = PILImage.fromarray(pixels, "RGBA")
    if mode == "I;16":
        return encode(PILImage.fromarray(pixels[..., 0].astype(np.uint16) * 257), "PNG")
    if mode == "CMYK":
        return encode(image.convert("CMYK"), "JPEG", quality=50)
    return encode(image.convert(mode), "PNG")


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux's peak RSS reset")
def test_each_mode_costs_its_decoded_picture_and_little_more(tmp_path: Path) -> None:
    """The peak resident memory of one 3000 x 3000 image (open_image, then the CLIP
    processor's frame) in a fresh process, per mode: the decoded picture (DECODED_BYTES a
    pixel) plus at most 0.5 bytes a pixel and 12 MB (measured at 7000 x 7000: the picture
    plus 1 to 6 MB). Converting the whole picture first (RGBA laid on white, 16-bit grey
    through int64) cost up to 26 bytes a pixel."""
    import subprocess
    import sys

    side = 3000
    folder = clip_folder(tmp_path, CLIPImageProcessorPil())
    for mode, per_pixel in DECODED_BYTES.items():
        path = tmp_path / mode.replace(";", "_")
        path.write_bytes(_large(mode, side))
        run = subprocess.run(  # a process of its own: nothing freed before to reuse
            [sys.executable, "-c", MEASURE, str(folder), str(path)],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=Path(__file__).resolve().parents[2],
        )
        assert run.returncode == 0, run.stderr[-3000:]
        grown_mb, pixels = json.loads(run.stdout)
        assert pixels == side * side
        bound = (per_pixel + 0.5) * pixels / 1e6 + 12
        assert grown_mb < bound, f"{mode}: {grown_mb:.0f} MB (bound {bound:.0f} MB)"
        assert grown_mb > per_pixel * pixels / 1e6 * 0.9, f"{mode}: the measure saw nothing"
