"""The Python clients (sync and async) on a served tiny CLAP: embed, classify (zero-shot),
score and rerank take audio clips as bytes and pathlib.Path beside texts, and answer as the
raw stub does for the same Items. Without a server: which bytes and files become audio."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from pooling_client import AsyncPoolingClient, PoolingClient, _images, _requests
from pooling_client.v1 import pooling_pb2 as pb
from pooling_client.v1 import pooling_pb2_grpc
from tests.audio_clips import clip
from tests.fixture_models import tiny_clap
from tests.server_process import ServerProcess, running_server

ATOL = 1e-5
LABELS = ["dog", "rain", "siren"]
WAV, FLAC, OGG = clip(fmt="WAV"), clip(0.9, 44_100, "FLAC", seed=1), clip(fmt="OGG", seed=2)
PNG = b"\x89PNG\r\n\x1a\n" + bytes(16)  # only its signature matters here


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("client-audio")
    args = ["--model", f"clap={tiny_clap(root / 'clap')}", "--dtype", "float32"]
    yield from running_server(args, root, "client-audio")


@pytest.fixture(scope="module")
def audio_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("client-audio-file") / "one.flac"
    path.write_bytes(FLAC)
    return path


def raw(server: ServerProcess, request: pb.PoolRequest) -> pb.PoolResponse:
    with grpc.insecure_channel(server.address) as channel:
        return pooling_pb2_grpc.PoolingServiceStub(channel).Pool(request, timeout=60)


def test_audio_bytes_and_files_become_audio_items(audio_file: Path) -> None:
    items = _images.as_inputs(["a", WAV, FLAC, OGG, audio_file, PNG])
    kinds = [item.WhichOneof("content") for item in items]
    assert kinds == ["text", "audio", "audio", "audio", "audio", "image"]
    assert items[4].audio.data == FLAC and items[4].audio.mime_type == "audio/flac"
    assert items[1].audio.mime_type == ""  # bytes: the server reads the format from them
    request = _requests.rerank_request("q", ["a", audio_file])
    assert list(request.documents) == [] and request.items[1].WhichOneof("content") == "audio"


def test_sync_client_embeds_audio_as_the_raw_stub(server: ServerProcess, audio_file: Path) -> None:
    items = [pb.Item(text="a dog"), pb.Item(audio=pb.AudioInput(data=FLAC))]
    reply = raw(server, pb.PoolRequest(model="clap", embed=pb.TextInput(items=items)))
    expected = np.array([list(e.values) for e in reply.embed.embeddings])
    with PoolingClient(server.address, model="clap") as client:
        for given in (FLAC, audio_file):
            got = client.embed(["a dog", given], output="numpy")
            np.testing.assert_allclose(got, expected, atol=ATOL)
        listed = client.embed(["a dog", WAV, OGG])
        assert [out.outputs.modality for out in listed] == ["text", "audio", "audio"]
        [info] = client.models()
        assert info.modalities == ["text", "audio"]


def test_async_client_scores_reranks_and_classifies_audio(
    server: ServerProcess, audio_file: Path
) -> None:
    classify = pb.TextInput(items=[pb.Item(audio=pb.AudioInput(data=WAV))], candidate_labels=LABELS)
    expected = raw(server, pb.PoolRequest(model="clap", classify=classify))
    [zero_shot] = expected.classify.classifications

    async def run() -> None:
        async with AsyncPoolingClient(server.address, model="clap") as client:
            vectors = await client.embed(["a dog", audio_file, WAV], output="numpy")
            cosines = vectors[1:] @ vectors[0]  # CLAP's features are unit vectors
            scores = await client.score("a dog", [audio_file, WAV])
            np.testing.assert_allclose([s.outputs.score for s in scores], cosines, atol=ATOL)
            ranked = await client.rerank("a dog", [audio_file, WAV])
            assert ranked.results[0].index == int(np.argmax(cosines))
            [classes] = await client.classify([WAV], candidate_labels=LABELS)
            np.testing.assert_allclose(classes.outputs.probs, zero_shot.probs, atol=ATOL)
            assert classes.outputs.modality == "audio"

    asyncio.run(run())
