"""The Python clients (sync and async) on issue 37's model families, served for real: a tiny
Qwen3 LLM reranker, a tiny ColBERT and MiniLM. ModelInfo carries every newer ModelCard field
(score_template_source, multi_vector, modalities, image_size, outputs) as the raw card has
it; rerank and score take an LLM reranker's instruction, scoring as the raw stub's Rerank
does, and another model refuses it. Without a server: the card conversion of modalities,
image_size and outputs, and rerank_request's instruction."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import pytest

from pooling_client import AsyncPoolingClient, PoolingClient, PoolingError, _requests
from pooling_client.outputs import ModelInfo
from pooling_client.v1 import pooling_pb2 as pb
from pooling_client.v1 import pooling_pb2_grpc
from tests.conftest import DEFAULT_MODEL as MINILM_ID
from tests.fixture_models import tiny_colbert, tiny_qwen3_reranker
from tests.server_process import ServerProcess, running_server

QUERY = "What is the capital of China?"
DOCUMENTS = ["The capital of China is Beijing.", "Gravity attracts bodies.", "yes"]
INSTRUCTION = "Judge whether the passage names a city"
ATOL = 1e-5


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("client-families")
    args = ["--model", f"rr={tiny_qwen3_reranker(root / 'rr')}"]
    args += ["--model", f"colbert={tiny_colbert(root / 'colbert')}"]
    args += ["--model", f"minilm={MINILM_ID}", "--dtype", "float32"]
    yield from running_server(args, root, "client-families")


@pytest.fixture(scope="module")
def cards(server: ServerProcess) -> dict[str, pb.ModelCard]:
    with grpc.insecure_channel(server.address) as channel:
        stub = pooling_pb2_grpc.PoolingServiceStub(channel)
        return {card.name: card for card in stub.ListModels(pb.ListModelsRequest()).models}


def raw_rerank(server: ServerProcess, instruction: str | None) -> dict[int, float]:
    """The scores the raw stub's Rerank gets, by document index."""
    request = pb.RerankRequest(model="rr", query=QUERY, documents=DOCUMENTS)
    if instruction is not None:
        request.instruction = instruction
    with grpc.insecure_channel(server.address) as channel:
        response = pooling_pb2_grpc.PoolingServiceStub(channel).Rerank(request, timeout=60)
    return {r.index: r.relevance_score for r in response.results}


def test_model_info_carries_the_newer_card_fields(
    server: ServerProcess, cards: dict[str, pb.ModelCard]
) -> None:
    with PoolingClient(server.address, timeout=60) as client:
        infos = {info.name: info for info in client.models()}

    async def run() -> list[ModelInfo]:
        async with AsyncPoolingClient(server.address, timeout=60) as aclient:
            return await aclient.models()

    assert {info.name: info for info in asyncio.run(run())} == infos
    assert infos["rr"].score_template_source == "score_template.json"
    assert infos["colbert"].multi_vector["query_prefix"] == "[Q] "
    for name, card in cards.items():
        info = infos[name]
        assert info.score_template_source == card.score_template_source
        assert info.image_size == card.image_size == 0
        assert info.outputs == list(card.outputs) == []
        assert info.modalities == ["text"]
        assert bool(info.multi_vector) == card.HasField("multi_vector")


@pytest.mark.parametrize("instruction", [None, INSTRUCTION])
def test_rerank_and_score_take_the_instruction(
    server: ServerProcess, instruction: str | None
) -> None:
    want = raw_rerank(server, instruction)
    with PoolingClient(server.address, timeout=60, model="rr") as client:
        ranked = client.rerank(QUERY, DOCUMENTS, instruction=instruction)
        scored = client.score(QUERY, DOCUMENTS, instruction=instruction)

    async def run() -> dict[int, float]:
        async with AsyncPoolingClient(server.address, timeout=60, model="rr") as aclient:
            result = await aclient.rerank(QUERY, DOCUMENTS, instruction=instruction)
        return {r.index: r.relevance_score for r in result}

    for got in ({r.index: r.relevance_score for r in ranked}, asyncio.run(run())):
        assert got.keys() == want.keys()
        assert all(got[i] == pytest.approx(want[i], abs=ATOL) for i in want)
    assert [o.outputs.score for o in scored] == pytest.approx(
        [want[i] for i in range(len(DOCUMENTS))], abs=ATOL
    )


def test_instruction_changes_the_scores(server: ServerProcess) -> None:
    assert raw_rerank(server, INSTRUCTION) != pytest.approx(raw_rerank(server, None), abs=ATOL)


def test_another_model_refuses_an_instruction(server: ServerProcess) -> None:
    with PoolingClient(server.address, timeout=60, model="minilm") as client:
        for call in (client.rerank, client.score):
            with pytest.raises(PoolingError) as caught:
                call(QUERY, ["a"], instruction="x")
            assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert caught.value.reason == "PROMPT_NOT_SUPPORTED_FOR_TASK"
            fields = [v.field for v in caught.value.field_violations]
            assert fields == ["instruction" if call == client.rerank else "prompt"]
            assert "LLM reranker" in str(caught.value)


# ---------------------------------------------------------------------------------------------
# Without a server
# ---------------------------------------------------------------------------------------------


def test_model_info_reads_modalities_image_size_and_outputs() -> None:
    card = pb.ModelCard(
        name="clip",
        modalities=[pb.MODALITY_TEXT, pb.MODALITY_IMAGE],
        image_size=224,
        outputs=["dense", "sparse", "multi"],
        score_template_source="--score-template",
    )
    info = ModelInfo.from_proto(card)
    assert info.modalities == ["text", "image"]
    assert (info.image_size, info.outputs) == (224, ["dense", "sparse", "multi"])
    assert info.score_template_source == "--score-template"
    bare = ModelInfo.from_proto(pb.ModelCard(name="old"))  # a server from before images
    assert (bare.modalities, bare.image_size, bare.outputs) == (["text"], 0, [])
    assert bare.score_template_source == ""


def test_rerank_request_sends_an_instruction_only_when_given() -> None:
    plain = _requests.rerank_request(QUERY, DOCUMENTS)
    assert not plain.HasField("instruction")
    given = _requests.rerank_request(QUERY, DOCUMENTS, instruction="")
    assert given.HasField("instruction") and given.instruction == ""
    with pytest.raises(TypeError, match="instruction"):
        _requests.rerank_request(QUERY, DOCUMENTS, instruction=3)  # type: ignore[arg-type]


def test_score_sends_the_instruction_as_prompt() -> None:
    request = _requests.pool_request("score", (["q"], ["d"]), prompt=INSTRUCTION)
    assert request.prompt == INSTRUCTION
