"""The Python clients (sync and async) on a served tiny CLIP: embed, classify (zero-shot),
score and rerank take images as bytes, pathlib.Path and PIL images beside texts, and
answer as the raw stub does for the same Items. Without a server: what becomes an Item."""

from __future__ import annotations

import asyncio
import io
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from PIL import Image as PILImage

from pooling_client import AsyncPoolingClient, PoolingClient, _images, _requests
from pooling_client.v1 import pooling_pb2 as pb
from pooling_client.v1 import pooling_pb2_grpc
from tests.fixture_models import tiny_clip
from tests.server_process import ServerProcess, running_model

ATOL = 1e-5
LABELS = ["cat", "dog", "car"]


def picture(seed: int) -> PILImage.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (40, 40, 3), dtype=np.uint8)
    return PILImage.fromarray(pixels)


def png(image: PILImage.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from running_model(tiny_clip, "clip", tmp_path_factory.mktemp("client-images"))


@pytest.fixture(scope="module")
def image_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("client-image-file") / "one.png"
    path.write_bytes(png(picture(1)))
    return path


def raw_embed(server: ServerProcess, items: list[pb.Item]) -> np.ndarray:
    request = pb.PoolRequest(model="clip", embed=pb.TextInput(items=items))
    with grpc.insecure_channel(server.address) as channel:
        reply = pooling_pb2_grpc.PoolingServiceStub(channel).Pool(request, timeout=60)
    return np.array([list(e.values) for e in reply.embed.embeddings])


def test_inputs_become_items(image_file: Path) -> None:
    assert _images.as_inputs(["a", "b"]) == ["a", "b"]
    items = _images.as_inputs(["a", png(picture(1)), image_file, picture(1)])
    assert [item.WhichOneof("content") for item in items] == ["text", "image", "image", "image"]
    assert items[1].image.data == items[2].image.data == items[3].image.data
    assert items[2].image.mime_type == "image/png" and items[1].image.mime_type == ""
    with pytest.raises(TypeError, match="must be a str"):
        _images.as_inputs(["a", 3])
    request = _requests.rerank_request("q", ["a", image_file])
    assert list(request.documents) == [] and len(request.items) == 2


def test_sync_client_embeds_images_as_the_raw_stub(server: ServerProcess, image_file: Path) -> None:
    image = picture(1)
    expected = raw_embed(
        server, [pb.Item(text="a photo of a cat"), pb.Item(image=pb.ImageInput(data=png(image)))]
    )
    with PoolingClient(server.address, model="clip") as client:
        for given in (png(image), image_file, image):
            got = client.embed(["a photo of a cat", given], output="numpy")
            np.testing.assert_allclose(got, expected, atol=ATOL)
        listed = client.embed(["a photo of a cat", image])
        assert [out.outputs.modality for out in listed] == ["text", "image"]
        texts = client.embed(["a photo of a cat"], output="numpy")
        np.testing.assert_allclose(texts[0], expected[0], atol=ATOL)


def test_async_client_scores_reranks_and_classifies_images(
    server: ServerProcess, image_file: Path
) -> None:
    async def run() -> None:
        async with AsyncPoolingClient(server.address, model="clip") as client:
            vectors = await client.embed(["a cat", image_file, picture(2)], output="numpy")
            scores = await client.score("a cat", [image_file, picture(2)])
            cosines = vectors[1:] @ vectors[0]
            cosines /= np.linalg.norm(vectors[1:], axis=1) * np.linalg.norm(vectors[0])
            np.testing.assert_allclose([s.outputs.score for s in scores], cosines, atol=ATOL)
            ranked = await client.rerank("a cat", [image_file, picture(2)])
            best = int(np.argmax(cosines))
            assert ranked.results[0].index == best
            classes = await client.classify([image_file], candidate_labels=LABELS)
            assert len(classes[0].outputs.probs) == len(LABELS)
            assert classes[0].outputs.modality == "image"
            assert abs(sum(classes[0].outputs.probs) - 1) < 1e-5

    asyncio.run(run())
