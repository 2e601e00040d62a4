"""A CLAP model through a real server (one for the module), on every door that takes
images: gRPC Pool (embed over texts and clips mixed, text-audio score, zero-shot classify
with candidate_labels), Rerank with audio documents, ListModels' modalities; HTTP's
/v1/embeddings with OpenAI's input_audio parts, /score and /rerank, Cohere's /v2/embed
(which has no audio part: refused by name), and a batch line. The references are
transformers' ClapModel features and its zero-shot-audio-classification pipeline on the
same tiny folder; bad clips are refused with their reason and field path on each door."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from transformers import pipeline

from pooling_client.v1 import pooling_pb2 as pb
from pooling_client.v1 import pooling_pb2_grpc
from pooling_server.engine.requests.request import Audio
from tests.audio_clips import clip, encode, tone
from tests.conftest import DEFAULT_MODEL as MINILM_ID
from tests.engine.families.test_clap import Reference, waveform
from tests.fixture_models import tiny_clap
from tests.rpc_errors import decode_rpc_error, decode_status
from tests.service.http_calls import HttpServer, batch_line, http_stub, run_batch, serve_models

ATOL = 1e-4
TEXT = "a dog barking"
LABELS = ["dog", "rain", "siren"]
CLIPS = [
    clip(0.6, 16_000, "WAV", frequency=300.0),
    encode(tone(1.5, 44_100, 660.0, channels=2, seed=1), 44_100, "FLAC"),
    clip(0.8, 48_000, "OGG", frequency=1000.0, seed=2),
]
LIMITS = ("--max-audio-seconds", "5", "--max-audio-clips-per-request", "4")


def audio_item(data: bytes, mime: str = "") -> pb.Item:
    return pb.Item(audio=pb.AudioInput(data=data, mime_type=mime))


def audio_part(data: bytes, fmt: str = "") -> dict[str, Any]:
    """OpenAI's chat content part for an audio clip."""
    given = {"data": base64.b64encode(data).decode()}
    return {"type": "input_audio", "input_audio": {**given, **({"format": fmt} if fmt else {})}}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_clap(tmp_path_factory.mktemp("served-audio") / "clap")


@pytest.fixture(scope="module")
def http(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpServer]:
    models = {"clap": folder, "minilm": MINILM_ID}
    yield from serve_models(tmp_path_factory, "audio", models, *LIMITS)


stub = http_stub


@pytest.fixture(scope="module")
def reference(folder: Path) -> Reference:
    return Reference(folder)


@pytest.fixture(scope="module")
def expected(reference: Reference) -> np.ndarray:
    """The text's row, then each clip's: transformers' (normalised) features."""
    return np.concatenate([reference.text([TEXT]), reference.audio([Audio(c) for c in CLIPS])])


def grpc_embed(stub: pooling_pb2_grpc.PoolingServiceStub) -> np.ndarray:
    items = [pb.Item(text=TEXT), *map(audio_item, CLIPS)]
    reply = stub.Pool(pb.PoolRequest(model="clap", embed=pb.TextInput(items=items)), timeout=60)
    assert [e.modality for e in reply.embed.embeddings] == [pb.MODALITY_TEXT] + [
        pb.MODALITY_AUDIO
    ] * len(CLIPS)
    return np.array([list(embedding.values) for embedding in reply.embed.embeddings])


def test_list_models_shows_audio(stub: pooling_pb2_grpc.PoolingServiceStub) -> None:
    cards = {card.name: card for card in stub.ListModels(pb.ListModelsRequest()).models}
    assert list(cards["clap"].modalities) == [pb.MODALITY_TEXT, pb.MODALITY_AUDIO]
    assert list(cards["minilm"].modalities) == [pb.MODALITY_TEXT]


def test_grpc_embed_equals_the_towers(
    stub: pooling_pb2_grpc.PoolingServiceStub, expected: np.ndarray
) -> None:
    np.testing.assert_allclose(grpc_embed(stub), expected, atol=ATOL)


def test_grpc_score_and_rerank_are_cosines(
    stub: pooling_pb2_grpc.PoolingServiceStub, expected: np.ndarray
) -> None:
    cosines = expected[1:] @ expected[0]
    score = pb.ScoreInput(items_1=[pb.Item(text=TEXT)], items_2=list(map(audio_item, CLIPS)))
    reply = stub.Pool(pb.PoolRequest(model="clap", score=score), timeout=60)
    np.testing.assert_allclose(list(reply.score.scores), cosines, atol=ATOL)
    request = pb.RerankRequest(
        model="clap",
        query=TEXT,
        items=list(map(audio_item, CLIPS)),
        return_documents=True,
    )
    ranked = stub.Rerank(request, timeout=60).results
    assert [r.index for r in ranked] == list(np.argsort(-cosines, kind="stable"))
    assert all(r.modality == pb.MODALITY_AUDIO and not r.document for r in ranked)
    np.testing.assert_allclose(
        [r.relevance_score for r in ranked], np.sort(cosines)[::-1], atol=ATOL
    )


def test_grpc_zero_shot_equals_the_pipeline(
    stub: pooling_pb2_grpc.PoolingServiceStub, folder: Path
) -> None:
    classifier = pipeline("zero-shot-audio-classification", model=str(folder))
    given = pb.TextInput(items=list(map(audio_item, CLIPS)), candidate_labels=LABELS)
    reply = stub.Pool(pb.PoolRequest(model="clap", classify=given), timeout=60)
    for data, result in zip(CLIPS, reply.classify.classifications, strict=True):
        rows = classifier(waveform(Audio(data)), candidate_labels=LABELS)
        expected = {row["label"]: row["score"] for row in rows}
        np.testing.assert_allclose(
            list(result.probs), [expected[label] for label in LABELS], atol=ATOL
        )
        assert result.label == max(expected, key=expected.__getitem__)
        assert result.modality == pb.MODALITY_AUDIO


GRPC_REFUSALS = [
    ("clap", [pb.Item(text="x"), audio_item(b"not audio")], "AUDIO_INVALID", "[1].audio"),
    ("clap", [audio_item(clip(6.0))], "AUDIO_TOO_LONG", "[0].audio"),
    ("clap", [audio_item(CLIPS[0], "audio/mpeg")], "AUDIO_FORMAT_UNSUPPORTED", "[0].audio"),
    ("clap", [audio_item(CLIPS[0])] * 5, "TOO_MANY_AUDIO_CLIPS", "items"),
    ("clap", [pb.Item()], "ITEM_EMPTY", "items[0]"),
    ("minilm", [audio_item(CLIPS[0])], "MODALITY_NOT_SUPPORTED", "[0].audio"),
]


@pytest.mark.parametrize(("model", "items", "reason", "path"), GRPC_REFUSALS)
def test_grpc_refusals_name_the_reason_and_field(
    stub: pooling_pb2_grpc.PoolingServiceStub,
    model: str,
    items: list[pb.Item],
    reason: str,
    path: str,
) -> None:
    request = pb.PoolRequest(model=model, embed=pb.TextInput(items=items))
    with pytest.raises(grpc.RpcError) as caught:
        stub.Pool(request, timeout=60)
    error = decode_rpc_error(caught.value)
    expected_code = (
        grpc.StatusCode.FAILED_PRECONDITION
        if reason == "MODALITY_NOT_SUPPORTED"
        else grpc.StatusCode.INVALID_ARGUMENT
    )
    assert (error.code, error.reason) == (expected_code, reason)
    assert error.bad_request is not None
    assert error.bad_request.field_violations[0].field.endswith(path)


def test_a_bad_clip_fails_its_own_request_in_a_stream(
    stub: pooling_pb2_grpc.PoolingServiceStub, expected: np.ndarray
) -> None:
    """Within a PoolStream, a clip that does not decode fails its request alone; the
    requests around it are served."""

    def embed(request_id: str, *items: pb.Item) -> pb.PoolStreamRequest:
        request = pb.PoolRequest(
            request_id=request_id, model="clap", embed=pb.TextInput(items=items)
        )
        return pb.PoolStreamRequest(request=request)

    messages = [
        embed("good", audio_item(CLIPS[0])),
        embed("bad", pb.Item(text=TEXT), audio_item(b"RIFF-not-really")),
        embed("after", pb.Item(text=TEXT)),
    ]
    answers = {r.request_id: r for r in stub.PoolStream(iter(messages))}
    assert set(answers) == {"good", "bad", "after"}
    error = decode_status(answers["bad"].error)
    assert (error.reason, error.fields) == ("AUDIO_INVALID", ["embed.items[1].audio"])
    got = list(answers["good"].response.embed.embeddings[0].values)
    np.testing.assert_allclose(got, expected[1], atol=ATOL)
    got = list(answers["after"].response.embed.embeddings[0].values)
    np.testing.assert_allclose(got, expected[0], atol=ATOL)


def test_openai_input_audio_equals_grpc(http: HttpServer, expected: np.ndarray) -> None:
    formats = ["wav", "flac", ""]  # the third: the bytes decide
    parts = [audio_part(data, fmt) for data, fmt in zip(CLIPS, formats, strict=True)]
    status, _, answer = http.call("/v1/embeddings", {"model": "clap", "input": [TEXT, *parts]})
    assert status == 200, answer
    got = np.array([row["embedding"] for row in answer["data"]])
    np.testing.assert_allclose(got, expected, atol=ATOL)
    assert [row["modality"] for row in answer["data"]] == ["text", "audio", "audio", "audio"]
    message = {"role": "user", "content": [audio_part(CLIPS[1])]}
    status, _, answer = http.call("/v1/embeddings", {"model": "clap", "messages": [message]})
    assert status == 200, answer
    np.testing.assert_allclose(answer["data"][0]["embedding"], expected[2], atol=ATOL)


def test_score_and_rerank_with_audio_documents(http: HttpServer, expected: np.ndarray) -> None:
    cosines = expected[1:] @ expected[0]
    parts = [{"content": [audio_part(data)]} for data in CLIPS]
    status, _, answer = http.call("/score", {"model": "clap", "text_1": TEXT, "text_2": parts})
    assert status == 200, answer
    np.testing.assert_allclose([row["score"] for row in answer["data"]], cosines, atol=ATOL)
    body = {"model": "clap", "query": TEXT, "documents": parts}
    status, _, answer = http.call("/rerank", body)
    assert status == 200, answer
    ranked = {row["index"]: row["relevance_score"] for row in answer["results"]}
    np.testing.assert_allclose([ranked[i] for i in range(len(CLIPS))], cosines, atol=ATOL)


HTTP_REFUSALS = [
    (
        "/v1/embeddings",
        {"model": "clap", "input": ["x", audio_part(b"x")]},
        "AUDIO_INVALID",
        "embed.items[1].audio",  # decoded by the engine: its path
    ),
    (
        "/v1/embeddings",
        {
            "model": "clap",
            "input": [
                {
                    "type": "input_audio",
                    "input_audio": {"data": "https://example.com/a.wav", "format": "wav"},
                }
            ],
        },
        "AUDIO_URL_NOT_ALLOWED",
        "input[0].input_audio.data",
    ),
    (
        "/v1/embeddings",
        {"model": "clap", "input": [{"type": "input_audio", "input_audio": {"data": "%%%"}}]},
        "AUDIO_INVALID",
        "input[0].input_audio.data",
    ),
    (
        "/v1/embeddings",
        {"model": "clap", "input": [audio_part(clip(6.0))]},
        "AUDIO_TOO_LONG",
        "embed.items[0].audio",
    ),
    (
        "/v1/embeddings",
        {"model": "minilm", "input": [audio_part(CLIPS[0])]},
        "MODALITY_NOT_SUPPORTED",
        "embed.items[0].audio",
    ),
    (
        "/v2/embed",
        {"model": "clap", "inputs": [{"content": [audio_part(CLIPS[0])]}]},
        "AUDIO_NOT_SUPPORTED",
        "inputs[0].content",
    ),
]


@pytest.mark.parametrize(("url", "body", "reason", "path"), HTTP_REFUSALS)
def test_http_refusals_name_the_reason_and_field(
    http: HttpServer, url: str, body: dict[str, Any], reason: str, path: str
) -> None:
    status, _, answer = http.call(url, body)
    assert status == (412 if reason == "MODALITY_NOT_SUPPORTED" else 400), answer
    error = answer.get("error", answer)
    assert error["reason"] == reason, answer
    if url == "/v1/embeddings":
        assert path in error["param"], answer
    else:  # Cohere's message names the field
        assert error["message"].startswith(f"invalid request: {path}"), answer


def test_a_batch_line_carries_audio(folder: Path, expected: np.ndarray) -> None:
    body = {"model": "clap", "input": [TEXT, *map(audio_part, CLIPS)]}
    answers = run_batch(
        ["--model", f"clap={folder}", "--dtype", "float32"],
        [batch_line("one", "/v1/embeddings", body)],
    )
    assert answers["one"]["status_code"] == 200, answers
    rows = answers["one"]["body"]["data"]
    np.testing.assert_allclose([row["embedding"] for row in rows], expected, atol=ATOL)
