"""Images over HTTP: the bodies' image forms read into the engine's items (no server), and
a real server serving the tiny CLIP fixture: /v1/embeddings (OpenAI-style parts and vLLM's
messages) and Cohere's /v2/embed equal to gRPC's embeddings of the same images; a remote
URL, a corrupt image and too many images refused with their field paths, in well under a
second, while a bystander is served (a decompression bomb among them); /score and /rerank
with image documents equal to gRPC's scores; a batch line carrying images as the body does."""

from __future__ import annotations

import base64
import io
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from huggingface_hub import InferenceClient
from PIL import Image as PILImage
from transformers import pipeline

from pooling_client.v1 import pooling_pb2 as pb
from pooling_client.v1 import pooling_pb2_grpc
from pooling_server.engine.errors import PoolingError
from pooling_server.engine.requests.request import Image, PoolRequest, RerankRequest
from pooling_server.service.http.json_body import decode
from pooling_server.service.http.openai import ROUTES
from tests.engine.test_image_decoding import png_claiming
from tests.fixture_models import tiny_clip
from tests.service.http_calls import HttpServer, grpc_stub, serving_http

ATOL = 1e-5


def png(seed: int, size: int = 48) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    out = io.BytesIO()
    PILImage.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def parsed(url: str, body: dict[str, Any]) -> PoolRequest | RerankRequest:
    raw = json.dumps(body).encode()
    route = ROUTES[url]
    return route.parse(decode(raw, route.body, 64), "id").request


# ------------------------------------------------------------------ bodies, no server


def test_input_parts_and_texts_become_items() -> None:
    one, two = png(1), png(2)
    request = parsed(
        "/v1/embeddings",
        {
            "input": [
                "a photo of a cat",
                image_part(data_url(one)),
                {"type": "image_url", "image_url": base64.b64encode(two).decode()},
                [{"type": "text", "text": "two"}, {"type": "text", "text": "parts"}],
            ]
        },
    )
    assert isinstance(request, PoolRequest) and request.texts == ()
    assert request.items == ("a photo of a cat", Image(one, "image/png"), Image(two), "two\nparts")


def test_texts_alone_stay_texts() -> None:
    request = parsed("/v1/embeddings", {"input": ["a", "b"]})
    assert isinstance(request, PoolRequest)
    assert request.texts == ("a", "b") and request.items == ()


def test_vllm_messages_are_one_input() -> None:
    one = png(3)
    message = {"role": "user", "content": [image_part(data_url(one, "image/png"))]}
    request = parsed("/v1/embeddings", {"messages": [message]})
    assert isinstance(request, PoolRequest) and request.items == (Image(one, "image/png"),)
    text = {"role": "user", "content": [{"type": "text", "text": "a dog"}]}
    request = parsed("/v1/embeddings", {"messages": [text]})
    assert isinstance(request, PoolRequest) and request.texts == ("a dog",)


def test_score_and_rerank_take_image_documents() -> None:
    one = png(4)
    request = parsed(
        "/score", {"text_1": "a cat", "text_2": [{"content": [image_part(data_url(one))]}, "x"]}
    )
    assert isinstance(request, PoolRequest)
    assert request.items_1 == ("a cat",) and request.items_2 == (Image(one, "image/png"), "x")
    rerank = parsed(
        "/rerank", {"query": "a cat", "documents": [image_part(data_url(one)), {"text": "t"}]}
    )
    assert isinstance(rerank, RerankRequest) and rerank.items == (Image(one, "image/png"), "t")


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("https://example.com/cat.png", "IMAGE_URL_NOT_ALLOWED"),
        ("http://127.0.0.1/cat.png", "IMAGE_URL_NOT_ALLOWED"),
        ("file:///etc/passwd", "IMAGE_URL_NOT_ALLOWED"),
        ("data:image/png,not-base64", "IMAGE_INVALID"),
        ("data:image/png;base64,@@@@", "IMAGE_INVALID"),
    ],
)
def test_urls_and_bad_base64_are_refused_at_the_door(url: str, reason: str) -> None:
    with pytest.raises(PoolingError) as caught:
        parsed("/v1/embeddings", {"input": ["text", image_part(url)]})
    assert caught.value.reason == reason
    assert caught.value.violations[0].field == "input[1].image_url"
    if reason == "IMAGE_URL_NOT_ALLOWED":
        assert "no URL is fetched" in caught.value.message


def test_a_text_and_an_image_in_one_input_are_refused() -> None:
    parts = [{"type": "text", "text": "a"}, image_part(data_url(png(5)))]
    with pytest.raises(PoolingError) as caught:
        parsed("/v1/embeddings", {"input": [parts]})
    assert caught.value.reason == "IMAGE_TEXT_MIXED"


def test_text_only_routes_refuse_images() -> None:
    with pytest.raises(PoolingError) as caught:
        parsed("/pooling", {"input": [image_part(data_url(png(6)))]})
    assert caught.value.violations[0].field == "input"


# ------------------------------------------------------------------ a real server


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_clip(tmp_path_factory.mktemp("images-http") / "clip")


@pytest.fixture(scope="module")
def http(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpServer]:
    args = ["--model", f"clip={folder}", "--dtype", "float32", "--max-images-per-request", "4"]
    with serving_http(args, tmp_path_factory.mktemp("images-http-log"), "images-http") as server:
        yield server


@pytest.fixture(scope="module")
def stub(http: HttpServer) -> Iterator[pooling_pb2_grpc.PoolingServiceStub]:
    yield from grpc_stub(http)


IMAGES = [png(10), png(11, 64)]


def grpc_embeddings(stub: pooling_pb2_grpc.PoolingServiceStub) -> np.ndarray:
    items = [pb.Item(text="a photo of a cat")]
    items += [pb.Item(image=pb.ImageInput(data=data)) for data in IMAGES]
    reply = stub.Pool(pb.PoolRequest(model="clip", embed=pb.TextInput(items=items)), timeout=60)
    return np.array([list(embedding.values) for embedding in reply.embed.embeddings])


def test_embeddings_equal_grpc(http: HttpServer, stub: pooling_pb2_grpc.PoolingServiceStub) -> None:
    expected = grpc_embeddings(stub)
    body = {"model": "clip", "input": ["a photo of a cat", *map(image_part, map(data_url, IMAGES))]}
    status, _, answer = http.call("/v1/embeddings", body)
    assert status == 200, answer
    got = np.array([row["embedding"] for row in answer["data"]])
    np.testing.assert_allclose(got, expected, atol=ATOL)
    assert [row["modality"] for row in answer["data"]] == ["text", "image", "image"]
    message = {"role": "user", "content": [image_part(data_url(IMAGES[0]))]}
    status, _, answer = http.call("/v1/embeddings", {"model": "clip", "messages": [message]})
    assert status == 200, answer
    np.testing.assert_allclose(answer["data"][0]["embedding"], expected[1], atol=ATOL)


def test_cohere_images_equal_grpc(
    http: HttpServer, stub: pooling_pb2_grpc.PoolingServiceStub
) -> None:
    expected = grpc_embeddings(stub)
    images = [data_url(data) for data in IMAGES]
    body = {"model": "clip", "input_type": "image", "images": images}
    status, _, answer = http.call("/v2/embed", body)
    assert status == 200, answer
    np.testing.assert_allclose(answer["embeddings"]["float"], expected[1:], atol=ATOL)
    inputs = [{"content": [{"type": "text", "text": "a photo of a cat"}]}]
    inputs += [{"content": [image_part(url)]} for url in images]
    status, _, answer = http.call("/v2/embed", {"model": "clip", "inputs": inputs})
    assert status == 200, answer
    np.testing.assert_allclose(answer["embeddings"]["float"], expected, atol=ATOL)


def test_score_and_rerank_with_image_documents_equal_grpc(
    http: HttpServer, stub: pooling_pb2_grpc.PoolingServiceStub
) -> None:
    query = pb.Item(text="a photo of a cat")
    documents = [pb.Item(image=pb.ImageInput(data=data)) for data in IMAGES]
    score = pb.ScoreInput(items_1=[query], items_2=documents)
    expected = list(stub.Pool(pb.PoolRequest(model="clip", score=score), timeout=60).score.scores)
    parts = [{"content": [image_part(data_url(data))]} for data in IMAGES]
    body = {"model": "clip", "text_1": "a photo of a cat", "text_2": parts}
    status, _, answer = http.call("/score", body)
    assert status == 200, answer
    np.testing.assert_allclose([row["score"] for row in answer["data"]], expected, atol=ATOL)
    body = {"model": "clip", "query": "a photo of a cat", "documents": parts}
    status, _, answer = http.call("/rerank", body)
    assert status == 200, answer
    ranked = {row["index"]: row["relevance_score"] for row in answer["results"]}
    np.testing.assert_allclose([ranked[i] for i in range(len(IMAGES))], expected, atol=ATOL)


def test_a_batch_line_carries_images_as_the_http_body(
    folder: Path, stub: pooling_pb2_grpc.PoolingServiceStub, tmp_path: Path
) -> None:
    expected = grpc_embeddings(stub)
    body = {"model": "clip", "input": ["a photo of a cat", *map(image_part, map(data_url, IMAGES))]}
    line = {"custom_id": "one", "method": "POST", "url": "/v1/embeddings", "body": body}
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(json.dumps(line) + "\n")
    command = [
        sys.executable,
        "-m",
        "pooling_server.service.launch",
        "batch",
        "--model",
        f"clip={folder}",
    ]
    command += ["--dtype", "float32", "--input", str(source), "--output", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    [answer] = [json.loads(text) for text in out.read_text().splitlines()]
    assert answer["response"]["status_code"] == 200, answer
    rows = answer["response"]["body"]["data"]
    np.testing.assert_allclose([row["embedding"] for row in rows], expected, atol=ATOL)


def _refusals() -> list[tuple[str, dict[str, Any], int, str, str]]:
    corrupt = bytearray(png(12))
    corrupt[60:160] = bytes(100)
    return [
        (
            "/v1/embeddings",
            {"model": "clip", "input": ["x", image_part("https://example.com/a.png")]},
            400,
            "IMAGE_URL_NOT_ALLOWED",
            "input[1].image_url",
        ),
        (
            "/v1/embeddings",
            {"model": "clip", "input": ["x", image_part(data_url(bytes(corrupt)))]},
            400,
            "IMAGE_INVALID",
            "[1]",
        ),
        (
            "/v1/embeddings",
            {"model": "clip", "input": [image_part(data_url(png(13)))] * 5},
            400,
            "TOO_MANY_IMAGES",
            "",
        ),
        (
            "/v1/embeddings",
            {"model": "clip", "input": ["x", image_part(data_url(png_claiming(50_000, 50_000)))]},
            400,
            "IMAGE_TOO_LARGE",
            "[1]",
        ),
        (
            "/v2/embed",
            {"model": "clip", "images": ["https://example.com/a.png"], "input_type": "image"},
            400,
            "IMAGE_URL_NOT_ALLOWED",
            "images[0]",
        ),
        (
            "/v2/embed",
            {"model": "clip", "images": [data_url(png(14)), data_url(bytes(corrupt))]},
            400,
            "IMAGE_INVALID",
            "images[1]",
        ),
        (
            "/v2/embed",
            {"model": "clip", "images": [data_url(png(15))] * 5, "input_type": "image"},
            400,
            "TOO_MANY_IMAGES",
            "images",
        ),
        (
            "/v2/embed",
            {"model": "clip", "inputs": [{"content": [image_part(data_url(png(15)))]}] * 5},
            400,
            "TOO_MANY_IMAGES",
            "inputs",
        ),
    ]


def test_refusals_are_quick_while_a_bystander_is_served(
    http: HttpServer, stub: pooling_pb2_grpc.PoolingServiceStub
) -> None:
    served: list[float] = []
    stop = threading.Event()

    def bystander() -> None:
        while not stop.is_set():
            start = time.perf_counter()
            grpc_embeddings(stub)
            served.append(time.perf_counter() - start)

    thread = threading.Thread(target=bystander)
    thread.start()
    try:
        for url, body, status, reason, path in _refusals():
            start = time.perf_counter()
            got, _, answer = http.call(url, body)
            took = time.perf_counter() - start
            assert got == status, answer
            error = answer.get("error", answer)
            assert error["reason"] == reason, answer
            if url == "/v1/embeddings" and path:
                assert path in error["param"], answer
            elif path:  # Cohere's message names the field
                assert error["message"].startswith(f"invalid request: {path}"), answer
            assert took < 1.0, (url, reason, took)
    finally:
        stop.set()
        thread.join()
    assert served, "the bystander was never answered"


# ------------------------------------------------------------------ huggingface_hub

ZERO_SHOT_LABELS = ["cat", "dog", "bird"]


def test_inference_client_zero_shot_equals_the_pipeline(http: HttpServer, folder: Path) -> None:
    """InferenceClient.zero_shot_image_classification on TEI's root route: transformers'
    zero-shot-image-classification pipeline's labels and scores, with Hugging Face's "{}"
    template or, with none, the server's --label-template ("a photo of a {label}.")."""
    client = InferenceClient(model=http.url("/?model=clip"))
    classify = pipeline("zero-shot-image-classification", model=str(folder), device="cpu")
    for data in IMAGES:
        image = PILImage.open(io.BytesIO(data))
        for template in ("This is a photo of {}.", None):
            got = client.zero_shot_image_classification(
                data, candidate_labels=ZERO_SHOT_LABELS, hypothesis_template=template
            )
            want = classify(
                image,
                candidate_labels=ZERO_SHOT_LABELS,
                hypothesis_template=template or "a photo of a {}.",
            )
            assert [e.label for e in got] == [w["label"] for w in want]
            np.testing.assert_allclose(
                [e.score for e in got], [w["score"] for w in want], atol=ATOL
            )


@pytest.mark.parametrize(
    ("parameters", "inputs", "field"),
    [
        (
            {"candidate_labels": ["cat"], "hypothesis_template": "a photo"},
            None,
            "hypothesis_template",
        ),
        ({"candidate_labels": ["cat", " "]}, None, "parameters.candidate_labels[1]"),
        ({"candidate_labels": []}, None, "candidate_labels"),
        ({"candidate_labels": ["cat"]}, "https://example.com/cat.png", "inputs"),
        ({"candidate_labels": ["cat"]}, data_url(b"not an image"), "inputs"),
    ],
)
def test_zero_shot_refusals_name_the_field(
    http: HttpServer, parameters: dict[str, Any], inputs: str | None, field: str
) -> None:
    body = {"model": "clip", "inputs": inputs or data_url(IMAGES[0]), "parameters": parameters}
    status, _, answer = http.call("/", body)
    assert 400 <= status < 500, answer
    assert set(answer) == {"error", "error_type"}, answer
    assert field in answer["error"], answer
