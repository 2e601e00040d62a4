"""Preprocessing one large image in each mode a client can send, side by side in one run:
seconds and peak memory per mode, so a mode that is slow or costly shows against RGB.

Each image (7000 x 7000 by default, a smooth random field with varying transparency, so
compositing does real work) is encoded once here, then decoded (open_image) and made the
CLIP processor's frame (engine/inputs/images.py) in a fresh process of its own: its peak resident
memory (VmHWM, reset before decoding) grows from nothing freed before. Times are the best
of --repeat runs in that process, the frame's wall and CPU seconds (CPU time is the steadier
figure on a shared machine); "x RGB" divides a mode's frame CPU seconds by RGB's; the peak
is the first run's. --root measures another checkout's engine (an older commit, say) with
the same images.

Run: python -m benchmarks.image_modes [--side 7000] [--repeat 3] [--modes RGB,RGBA] [--root DIR]
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

MODES = ("RGB", "RGBA", "LA", "CMYK", "I;16", "P", "P-transparent", "L")

CHILD = r"""
import json, sys, time
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
repeat = int(sys.argv[3])
limits = Limits(max_image_bytes=len(data))  # the pixels are the measure, not the bytes
Path("/proc/self/clear_refs").write_text("5")
before = psutil.Process().memory_info().rss
decode, frame, cpu, grown = [], [], [], None
for _ in range(repeat):
    start = time.perf_counter()
    opened = open_image(Encoded(data), limits, "x", processor.target)
    middle, middle_cpu = time.perf_counter(), time.process_time()
    processor.frame(opened.picture, opened.transpose)
    decode.append(middle - start)
    frame.append(time.perf_counter() - middle)
    cpu.append(time.process_time() - middle_cpu)
    mode = opened.picture.mode
    opened.close()
    del opened
    if grown is None:
        grown = (peak() - before) / 1e6
print(json.dumps({"decoded_mode": mode, "decode": min(decode), "frame": min(frame),
                  "cpu": min(cpu), "peak_mb": grown}))
"""


def encode(mode: str, side: int) -> bytes:
    """`mode` at side x side: a smooth field of colour and alpha, PNG (JPEG for CMYK)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    small = Image.fromarray(rng.integers(0, 256, (side // 100 + 2,) * 2 + (4,), np.uint8))
    rgba = small.resize((side, side), Image.Resampling.BILINEAR)
    out = io.BytesIO()
    if mode == "I;16":
        values = np.asarray(rgba.getchannel(0), np.uint16) * 257 + 3
        Image.fromarray(values).save(out, "PNG", compress_level=1)
    elif mode == "CMYK":
        rgba.convert("CMYK").save(out, "JPEG", quality=90)
    elif mode in ("P", "P-transparent"):
        colours = small.convert("RGB").quantize(64)  # a palette, then the large picture in it
        palette = rgba.convert("RGB").quantize(palette=colours, dither=Image.Dither.NONE)
        if mode == "P-transparent":
            palette.info["transparency"] = 5
        palette.save(out, "PNG", compress_level=1)
    else:
        rgba.convert(mode).save(out, "PNG", compress_level=1)
    return out.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", type=int, default=7000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    args = parser.parse_args()
    root = args.root
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "clip"
        folder.mkdir()
        config = {"image_processor_type": "CLIPImageProcessor"}  # its defaults: 224, crop
        (folder / "preprocessor_config.json").write_text(json.dumps(config))
        for mode in args.modes.split(","):
            path = Path(tmp) / "image"
            path.write_bytes(encode(mode, args.side))
            run = subprocess.run(
                [sys.executable, "-c", CHILD, str(folder), str(path), str(args.repeat)],
                capture_output=True,
                text=True,
                cwd=root,
                check=False,
            )
            if run.returncode != 0:
                sys.exit(f"{mode}: {run.stderr[-2000:]}")
            rows.append((mode, json.loads(run.stdout)))
    rgb = next((r["cpu"] for m, r in rows if m == "RGB"), None)
    print(f"{args.side} x {args.side}, CLIP processor, best of {args.repeat}, {root}")
    print(
        f"{'mode':<14} {'decoded':<8} {'decode s':>9} {'frame s':>8} {'frame cpu s':>12} "
        f"{'x RGB':>6} {'peak MB':>8}"
    )
    for mode, r in rows:
        ratio = f"{r['cpu'] / rgb:.2f}" if rgb else "-"
        print(
            f"{mode:<14} {r['decoded_mode']:<8} {r['decode']:>9.2f} {r['frame']:>8.2f} "
            f"{r['cpu']:>12.2f} {ratio:>6} {r['peak_mb']:>8.0f}"
        )


if __name__ == "__main__":
    main()
