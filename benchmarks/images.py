"""Image embedding throughput: the server against sentence-transformers in-process, side by
side in one run, on a random-weight CLIP with ViT-B/32's image tower (12 layers, 768 wide,
32-pixel patches, 224 pixels; a small text tower), and the front end's decode and preprocess
cost per image (engine/inputs/images.py on the same JPEGs).

The server is loaded as issue 38's target says: 224x224 JPEGs, 8 images per request, C=8
requests in flight from the Python async client. sentence-transformers encodes the same
JPEGs (opened with Pillow, as a caller would) at its best batch size of a few tried.
Speed depends on shapes, not weights, so random weights measure what clip-ViT-B-32 would.

Run: python -m benchmarks.images [--seconds 20] [--out benchmarks/results/images.json]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

PER_REQUEST = 8
CONCURRENCY = 8
ST_BATCHES = (8, 32, 64)


def build_clip(folder: Path) -> Path:
    """clip-ViT-B-32's layout (modules.json naming a CLIPModel module in 0_CLIPModel) with
    random weights: ViT-B/32's image tower, a 4-layer 256-wide text tower, 512-wide output."""
    import torch
    from transformers import AutoTokenizer, CLIPConfig, CLIPImageProcessorPil, CLIPModel

    from tests.fixture_models import MINILM

    inner = folder / "0_CLIPModel"
    vision = {
        "hidden_size": 768,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "intermediate_size": 3072,
        "image_size": 224,
        "patch_size": 32,
    }
    text = {
        "vocab_size": 30522,
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "intermediate_size": 1024,
        "max_position_embeddings": 77,
        "bos_token_id": 101,
        "eos_token_id": 102,
        "pad_token_id": 0,
    }
    torch.manual_seed(0)
    config = CLIPConfig(text_config=text, vision_config=vision, projection_dim=512)
    CLIPModel(config).save_pretrained(inner)
    names = ["input_ids", "attention_mask"]
    AutoTokenizer.from_pretrained(MINILM, model_input_names=names).save_pretrained(inner)
    CLIPImageProcessorPil().save_pretrained(inner)
    module = {"idx": 0, "name": "0", "path": "0_CLIPModel"}
    module["type"] = "sentence_transformers.models.CLIPModel"
    (folder / "modules.json").write_text(json.dumps([module]))
    return folder


def jpegs(count: int, size: int = 224) -> list[bytes]:
    """Photographs stand-ins: smooth random fields (so JPEG sizes are realistic), quality 90."""
    from PIL import Image

    rng = np.random.default_rng(0)
    out = []
    for _ in range(count):
        small = rng.integers(0, 256, (size // 8, size // 8, 3), dtype=np.uint8)
        picture = Image.fromarray(small).resize((size, size), Image.Resampling.BICUBIC)
        buffer = io.BytesIO()
        picture.save(buffer, "JPEG", quality=90)
        out.append(buffer.getvalue())
    return out


def front_end_cost(folder: Path, images: list[bytes], rounds: int = 3) -> dict[str, float]:
    """Microseconds per image of the front end's work: decode (engine/inputs/images.py's
    decode_image) and preprocess (the model's processor, reproduced), on one thread."""
    from pooling_server.engine.inputs.image_decoding import decode_image
    from pooling_server.engine.inputs.images import load_image_processor
    from pooling_server.engine.requests.request import Image
    from pooling_server.engine.requests.resolved import Limits

    processor = load_image_processor(folder)
    assert processor is not None
    limits = Limits()
    items = [Image(data, "image/jpeg") for data in images]
    best_decode = best_pre = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        pictures = [decode_image(item, limits, "x") for item in items]
        decoded = time.perf_counter()
        processor(pictures)
        done = time.perf_counter()
        best_decode = min(best_decode, (decoded - start) / len(items))
        best_pre = min(best_pre, (done - decoded) / len(items))
    return {
        "decode_us": round(best_decode * 1e6, 1),
        "preprocess_us": round(best_pre * 1e6, 1),
        "total_us": round((best_decode + best_pre) * 1e6, 1),
    }


def sentence_transformers_rate(folder: Path, images: list[bytes], seconds: float) -> dict[str, Any]:
    """Images per second of SentenceTransformer.encode on the JPEGs (opened per call), at
    the best of ST_BATCHES."""
    from PIL import Image
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu")
    best: tuple[float, int] = (0.0, 0)
    for batch in ST_BATCHES:
        model.encode([Image.open(io.BytesIO(images[0]))] * batch, batch_size=batch)  # warm
        done, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds / len(ST_BATCHES):
            chunk = images[done % len(images) :][:batch] or images[:batch]
            model.encode([Image.open(io.BytesIO(data)) for data in chunk], batch_size=batch)
            done += len(chunk)
        rate = done / (time.perf_counter() - start)
        best = max(best, (rate, batch))
    return {"images_per_s": round(best[0], 1), "batch_size": best[1]}


async def _load(address: str, images: list[bytes], seconds: float) -> tuple[int, float]:
    from pooling_client import AsyncPoolingClient

    async with AsyncPoolingClient(address, model="clip") as client:
        await client.embed(images[:PER_REQUEST])  # warm
        stop = time.perf_counter() + seconds
        counts = [0] * CONCURRENCY

        async def worker(n: int) -> None:
            at = n * PER_REQUEST
            while time.perf_counter() < stop:
                batch = [images[(at + i) % len(images)] for i in range(PER_REQUEST)]
                await client.embed(batch)
                counts[n] += PER_REQUEST
                at += PER_REQUEST * CONCURRENCY

        start = time.perf_counter()
        await asyncio.gather(*(worker(n) for n in range(CONCURRENCY)))
        return sum(counts), time.perf_counter() - start


def server_rate(folder: Path, images: list[bytes], seconds: float, log_dir: Path) -> dict[str, Any]:
    """Images per second through the server at C=8 requests of 8 JPEGs."""
    from benchmarks.servers import start_project_server

    target = start_project_server("clip", str(folder), 512, ["--dtype", "float32"], log_dir)
    try:
        done, elapsed = asyncio.run(_load(target.address, images, seconds))
    finally:
        target.stop()
    return {"images_per_s": round(done / elapsed, 1), "requests_in_flight": CONCURRENCY}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="load time of each side")
    parser.add_argument("--images", type=int, default=256, help="distinct JPEGs")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        folder = build_clip(root / "clip-vit-b-32-random")
        images = jpegs(args.images)
        cost = front_end_cost(folder / "0_CLIPModel", images)
        reference = sentence_transformers_rate(folder, images, args.seconds)
        served = server_rate(folder, images, args.seconds, root)
    results = {
        "model": "random-weight CLIP, ViT-B/32 image tower (12 x 768, patch 32, 224 px)",
        "workload": f"224x224 JPEGs, {PER_REQUEST} images per request, C={CONCURRENCY}",
        "cpus": len(os.sched_getaffinity(0)),
        "sentence_transformers": reference,
        "server": served,
        "ratio": round(served["images_per_s"] / reference["images_per_s"], 2),
        "front_end_per_image": cost,
    }
    print(
        f"sentence-transformers in-process: {reference['images_per_s']} images/s "
        f"(batch {reference['batch_size']})\n"
        f"server (C={CONCURRENCY}, {PER_REQUEST} per request): {served['images_per_s']} images/s\n"
        f"ratio server / sentence-transformers: {results['ratio']}x\n"
        f"front end per image: decode {cost['decode_us']} us + preprocess "
        f"{cost['preprocess_us']} us = {cost['total_us']} us"
    )
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
