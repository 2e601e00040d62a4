"""Image models through a real server's gRPC door (one server, its engine in its own
process): Pool embed over texts and images mixed, score text-image, Rerank with image
documents, zero-shot classify, ListModels' image fields, and bad images refused with their
reason and field path, on Pool and within a PoolStream that goes on serving the rest. The
references are transformers' own towers on the same tiny CLIP and SigLIP folders."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from PIL import Image as PILImage
from transformers import AutoImageProcessor, AutoModel, AutoTokenizer

from pooling_client.v1 import pooling_pb2 as pb
from pooling_client.v1 import pooling_pb2_grpc
from tests.conftest import DEFAULT_MODEL as MINILM_ID
from tests.fixture_models import tiny_clip, tiny_siglip, tiny_siglip2
from tests.rpc_errors import decode_rpc_error, decode_status
from tests.service.http_calls import HttpServer, http_stub, serve_models

ATOL = 2e-4
TEXTS = ["a photo of a cat", "a red car on a road"]
LABELS = ["cat", "dog", "car"]


def png(seed: int, fmt: str = "PNG") -> bytes:
    rng = np.random.default_rng(seed)
    image = PILImage.fromarray(rng.integers(0, 256, (36, 44, 3), dtype=np.uint8), "RGB")
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


IMAGES = [png(0), png(1, "JPEG"), png(2, "WEBP")]
DECODED = [PILImage.open(io.BytesIO(data)).convert("RGB") for data in IMAGES]


def text_item(text: str) -> pb.Item:
    return pb.Item(text=text)


def image_item(data: bytes, mime: str = "") -> pb.Item:
    return pb.Item(image=pb.ImageInput(data=data, mime_type=mime))


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("served-images")
    return {
        "clip": tiny_clip(root / "clip"),
        "siglip": tiny_siglip(root / "siglip"),
        "siglip2": tiny_siglip2(root / "siglip2"),
    }


@pytest.fixture(scope="module")
def http(
    folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[HttpServer]:
    yield from serve_models(tmp_path_factory, "images", {**folders, "minilm": MINILM_ID})


stub = http_stub


class Towers:
    """transformers' model with its own tokenizer and image processor."""

    def __init__(self, folder: Path) -> None:
        self.model = AutoModel.from_pretrained(folder).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.processor = AutoImageProcessor.from_pretrained(folder)
        self.siglip = self.model.config.model_type in ("siglip", "siglip2")

    def texts(self, texts: list[str]) -> dict[str, torch.Tensor]:
        if self.siglip:
            length = self.model.config.text_config.max_position_embeddings
            return self.tokenizer(
                texts, padding="max_length", max_length=length, return_tensors="pt"
            )
        return self.tokenizer(texts, padding=True, return_tensors="pt")

    def pixels(self, images: list[PILImage.Image]) -> dict[str, torch.Tensor]:
        """pixel_values, and for SigLIP 2 its pixel_attention_mask and spatial_shapes."""
        return dict(self.processor(images=images, return_tensors="pt"))

    @torch.inference_mode()
    def text(self, texts: list[str]) -> np.ndarray:
        return unit(self.model.get_text_features(**self.texts(texts)).pooler_output.numpy())

    @torch.inference_mode()
    def image(self, images: list[PILImage.Image]) -> np.ndarray:
        output = self.model.get_image_features(**self.pixels(images))
        return unit(output.pooler_output.numpy())

    @torch.inference_mode()
    def logits_per_image(self, images: list[PILImage.Image], texts: list[str]) -> torch.Tensor:
        output = self.model(**self.texts(texts), **self.pixels(images))
        return output.logits_per_image


def unit(rows: np.ndarray) -> np.ndarray:
    return rows / np.linalg.norm(rows, axis=-1, keepdims=True)


@pytest.fixture(scope="module")
def towers(folders: dict[str, Path]) -> dict[str, Towers]:
    return {name: Towers(folder) for name, folder in folders.items()}


def test_list_models_shows_modalities_and_image_size(
    stub: pooling_pb2_grpc.PoolingServiceStub,
) -> None:
    cards = {card.name: card for card in stub.ListModels(pb.ListModelsRequest()).models}
    for name, width, size in (("clip", 24, 32), ("siglip", 32, 32), ("siglip2", 32, 16)):
        card = cards[name]
        assert list(card.modalities) == [pb.MODALITY_TEXT, pb.MODALITY_IMAGE]
        assert card.image_size == size and card.hidden_size == width
        assert set(card.tasks) == {
            pb.POOLING_TASK_EMBED,
            pb.POOLING_TASK_SCORE,
            pb.POOLING_TASK_CLASSIFY,
        }
    assert list(cards["minilm"].modalities) == [pb.MODALITY_TEXT]
    assert cards["minilm"].image_size == 0


@pytest.mark.parametrize("name", ["clip", "siglip", "siglip2"])
def test_embed_mixed_items(
    stub: pooling_pb2_grpc.PoolingServiceStub, towers: dict[str, Towers], name: str
) -> None:
    items = [image_item(IMAGES[0], "image/png"), text_item(TEXTS[0]), image_item(IMAGES[1])]
    items.append(image_item(IMAGES[2]))
    response = stub.Pool(pb.PoolRequest(model=name, embed=pb.TextInput(items=items)))
    got = np.array([list(e.values) for e in response.embed.embeddings])
    images, texts = towers[name].image(DECODED), towers[name].text(TEXTS[:1])
    np.testing.assert_allclose(got, [images[0], texts[0], images[1], images[2]], atol=ATOL)
    modalities = [e.modality for e in response.embed.embeddings]
    assert modalities == [pb.MODALITY_IMAGE, pb.MODALITY_TEXT, pb.MODALITY_IMAGE, pb.MODALITY_IMAGE]


def test_score_text_against_images(
    stub: pooling_pb2_grpc.PoolingServiceStub, towers: dict[str, Towers]
) -> None:
    score = pb.ScoreInput(
        items_1=[text_item(TEXTS[1])], items_2=[image_item(data) for data in IMAGES]
    )
    response = stub.Pool(pb.PoolRequest(model="clip", score=score))
    expected = towers["clip"].image(DECODED) @ towers["clip"].text(TEXTS[1:])[0]
    np.testing.assert_allclose(list(response.score.scores), expected, atol=ATOL)


@pytest.mark.parametrize("name", ["siglip", "siglip2"])
def test_rerank_with_image_documents(
    stub: pooling_pb2_grpc.PoolingServiceStub, towers: dict[str, Towers], name: str
) -> None:
    items = [image_item(IMAGES[0]), text_item(TEXTS[0]), image_item(IMAGES[2])]
    request = pb.RerankRequest(model=name, query=TEXTS[1], items=items, return_documents=True)
    response = stub.Rerank(request)
    reference = towers[name]
    query = reference.text(TEXTS[1:])[0]
    images = reference.image([DECODED[0], DECODED[2]])
    expected = [images[0] @ query, reference.text(TEXTS[:1])[0] @ query, images[1] @ query]
    order = np.argsort(-np.array(expected), kind="stable").tolist()
    assert [r.index for r in response.results] == order
    np.testing.assert_allclose(
        [r.relevance_score for r in response.results], np.array(expected)[order], atol=ATOL
    )
    for result in response.results:
        is_text = result.index == 1
        assert result.modality == (pb.MODALITY_TEXT if is_text else pb.MODALITY_IMAGE)
        assert result.HasField("document") == is_text
        assert not is_text or result.document == TEXTS[0]


@pytest.mark.parametrize("name", ["clip", "siglip", "siglip2"])
def test_zero_shot_classify(
    stub: pooling_pb2_grpc.PoolingServiceStub, towers: dict[str, Towers], name: str
) -> None:
    given = pb.TextInput(items=[image_item(data) for data in IMAGES], candidate_labels=LABELS)
    response = stub.Pool(pb.PoolRequest(model=name, classify=given))
    logits = towers[name].logits_per_image(DECODED, [f"a photo of a {x}." for x in LABELS])
    expected = (logits.softmax(-1) if name == "clip" else logits.sigmoid()).numpy()
    got = response.classify.classifications
    np.testing.assert_allclose([list(c.probs) for c in got], expected, atol=ATOL)
    assert [c.label for c in got] == [LABELS[int(i)] for i in expected.argmax(-1)]
    assert all(c.modality == pb.MODALITY_IMAGE for c in got)


def test_a_corrupt_image_names_its_path(stub: pooling_pb2_grpc.PoolingServiceStub) -> None:
    items = [text_item("a"), image_item(IMAGES[0]), image_item(IMAGES[0][:50])]
    with pytest.raises(grpc.RpcError) as raised:
        stub.Pool(pb.PoolRequest(model="clip", embed=pb.TextInput(items=items)))
    error = decode_rpc_error(raised.value)
    assert error.code is grpc.StatusCode.INVALID_ARGUMENT
    assert (error.reason, error.fields) == ("IMAGE_INVALID", ["embed.items[2].image"])


def test_refusals_on_the_door(stub: pooling_pb2_grpc.PoolingServiceStub) -> None:
    cases = [
        (  # an image to a text-only model
            pb.PoolRequest(model="minilm", embed=pb.TextInput(items=[image_item(IMAGES[0])])),
            grpc.StatusCode.FAILED_PRECONDITION,
            "MODALITY_NOT_SUPPORTED",
            ["embed.items[0].image"],
        ),
        (  # texts and items together
            pb.PoolRequest(
                model="clip", embed=pb.TextInput(texts=["a"], items=[image_item(IMAGES[0])])
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "ITEMS_AND_TEXTS",
            ["embed.texts"],
        ),
        (  # classify on an image model without labels
            pb.PoolRequest(model="clip", classify=pb.TextInput(items=[image_item(IMAGES[0])])),
            grpc.StatusCode.INVALID_ARGUMENT,
            "CANDIDATE_LABELS_MISSING",
            ["classify.candidate_labels"],
        ),
        (  # a format Pillow knows and this server does not serve
            pb.PoolRequest(model="clip", embed=pb.TextInput(items=[image_item(png(3, "BMP"))])),
            grpc.StatusCode.INVALID_ARGUMENT,
            "IMAGE_FORMAT_UNSUPPORTED",
            ["embed.items[0].image"],
        ),
    ]
    for request, code, reason, fields in cases:
        with pytest.raises(grpc.RpcError) as raised:
            stub.Pool(request)
        error = decode_rpc_error(raised.value)
        assert (error.code, error.reason, error.fields) == (code, reason, fields)


def test_a_bad_image_fails_its_own_stream_request(
    stub: pooling_pb2_grpc.PoolingServiceStub, towers: dict[str, Towers]
) -> None:
    good = pb.PoolRequest(
        request_id="good", model="clip", embed=pb.TextInput(items=[image_item(IMAGES[1])])
    )
    bad = pb.PoolRequest(
        request_id="bad",
        model="clip",
        embed=pb.TextInput(items=[text_item("a"), image_item(b"\x89PNG\r\n\x1a\n broken")]),
    )
    after = pb.PoolRequest(
        request_id="after", model="clip", embed=pb.TextInput(items=[text_item(TEXTS[0])])
    )
    messages = [pb.PoolStreamRequest(request=r) for r in (good, bad, after)]
    answers = {r.request_id: r for r in stub.PoolStream(iter(messages))}
    assert set(answers) == {"good", "bad", "after"}
    error = decode_status(answers["bad"].error)
    assert (error.reason, error.fields) == ("IMAGE_INVALID", ["embed.items[1].image"])
    got = list(answers["good"].response.embed.embeddings[0].values)
    np.testing.assert_allclose(got, towers["clip"].image(DECODED[1:2])[0], atol=ATOL)
    got = list(answers["after"].response.embed.embeddings[0].values)
    np.testing.assert_allclose(got, towers["clip"].text(TEXTS[:1])[0], atol=ATOL)


def test_many_items_are_counted_on_the_wire() -> None:
    """A large message's items (and zero-shot labels) are counted before protobuf parses
    it, as texts are, each list named as the rules name it."""
    from pooling_server.service.grpc.wire_count import SPECS, list_over_limit

    many = [text_item("ab")] * 20_000
    cases = [
        (pb.PoolRequest(embed=pb.TextInput(items=many)), "PoolRequest", "embed.items"),
        (
            pb.PoolRequest(classify=pb.TextInput(items=many[:1], candidate_labels=["x"] * 30_000)),
            "PoolRequest",
            "classify.candidate_labels",
        ),
        (
            pb.PoolRequest(score=pb.ScoreInput(items_1=many[:1], items_2=many)),
            "PoolRequest",
            "score.items_2",
        ),
        (pb.RerankRequest(query="q", items=many), "RerankRequest", "items"),
    ]
    for message, kind, path in cases:
        assert list_over_limit(message.SerializeToString(), SPECS[kind], 1024) == path
    fits = pb.PoolRequest(embed=pb.TextInput(items=many[:1000], texts=["x" * 70_000]))
    assert list_over_limit(fits.SerializeToString(), SPECS["PoolRequest"], 1024) is None
