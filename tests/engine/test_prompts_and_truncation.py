"""Prompts and `--long-input truncate`: parity with sentence-transformers over a real server.

The server serves tiny random models whose sentence-transformers folders declare prompts
(config_sentence_transformers.json); the references are sentence-transformers' own
`encode(prompt_name=...)` / `encode(prompt=...)`, which prepend the prompt and (with the
Pooling module's include_prompt false) leave its tokens out of the pooling, and its silent
truncation at max_seq_length.
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from sentence_transformers import CrossEncoder, SentenceTransformer, SparseEncoder
from sentence_transformers.sparse_encoder.modules import SpladePooling, Transformer
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BertForMaskedLM,
    BertModel,
)

from pooling_client import AsyncPoolingClient, PoolingClient, PoolingParams
from pooling_client.v1 import pooling_pb2 as pb
from pooling_client.v1 import pooling_pb2_grpc
from tests.fixture_models import (
    MAX_POSITIONS,
    _bert_config,
    _labels,
    _save,
    _sentence_transformers_layout,
)
from tests.rpc_errors import DecodedError, decode_rpc_error
from tests.server_process import ServerProcess, start_server

ATOL = 1e-4
PROMPTS = {
    "query": "query: ",
    "passage": "passage: ",
    "instruct": "Represent this sentence for searching relevant passages: ",
}
TEXTS = [
    "Hello world",
    "",
    "The quick brown fox jumps over the lazy dog.",
    "Ünïcödé façade: naïve café, Straße, 東京タワー 🙂",
    " ".join(["the powerhouse of the cell is the mitochondria"] * 8),
]
# 272 tokens with specials: over every tiny model's 128.
LONG_TEXT = " ".join(f"Sentence {i} mentions topic {i * 7 % 13}, and Zürich." for i in range(30))
LONG_TEXTS = [
    LONG_TEXT,
    "short one",
    "hello " * (MAX_POSITIONS - 1),
    "hello " * (MAX_POSITIONS - 2),
]


def _st_folder(root: Path, name: str, pooling: str, include_prompt: bool = True) -> Path:
    folder = _save(BertModel(_bert_config()), root / name)
    _sentence_transformers_layout(folder, pooling, normalize=True)
    pooling_config = folder / "1_Pooling" / "config.json"
    config = json.loads(pooling_config.read_text())
    pooling_config.write_text(json.dumps({**config, "include_prompt": include_prompt}))
    (folder / "config_sentence_transformers.json").write_text(
        json.dumps({"prompts": PROMPTS, "default_prompt_name": "query"})
    )
    return folder


def _sparse_folder(root: Path) -> Path:
    """A SparseEncoder (masked LM + SPLADE max pooling) saved with prompts by
    sentence-transformers itself."""
    mlm = _save(BertForMaskedLM(_bert_config()), root / "mlm")
    folder = root / "sparse"
    encoder = SparseEncoder(
        modules=[Transformer(str(mlm), transformer_task="fill-mask"), SpladePooling("max")],
        prompts=PROMPTS,
        device="cpu",
    )
    encoder.save(str(folder))
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("prompt-models")
    torch.manual_seed(1)
    return {
        "prompts": _st_folder(root, "prompts", "mean"),
        "exclude-mean": _st_folder(root, "exclude-mean", "mean", include_prompt=False),
        "exclude-cls": _st_folder(root, "exclude-cls", "cls", include_prompt=False),
        "cross": _save(
            AutoModelForSequenceClassification.from_config(_bert_config(**_labels(["relevance"]))),
            root / "cross",
        ),
        "sparse": _sparse_folder(root),
        "classifier": _save(
            AutoModelForSequenceClassification.from_config(
                _bert_config(**_labels(["negative", "neutral", "positive"]))
            ),
            root / "classifier",
        ),
    }


# name -> (folder, --default-prompt-name, --long-input, --truncation-side)
SERVED = {
    "prompts": ("prompts", "auto", "reject", "right"),
    "prompts-none": ("prompts", "", "reject", "right"),
    "prompts-passage": ("prompts", "passage", "reject", "right"),
    "exclude-mean": ("exclude-mean", "", "reject", "right"),
    "exclude-cls": ("exclude-cls", "", "reject", "right"),
    "truncate": ("prompts", "", "truncate", "right"),
    "truncate-left": ("prompts", "", "truncate", "left"),
    "cross-truncate": ("cross", "auto", "truncate", "right"),
    "cross-truncate-left": ("cross", "auto", "truncate", "left"),
    "classifier-truncate": ("classifier", "auto", "truncate", "right"),
    "sparse-prompts": ("sparse", "auto", "reject", "right"),
}


@pytest.fixture(scope="module")
def server(
    folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    args = ["--dtype", "float32"]
    for name, (folder, *_) in SERVED.items():
        args += ["--model", f"{name}={folders[folder]}"]
    for _, prompt_name, long_input, side in SERVED.values():
        args += ["--default-prompt-name", prompt_name, "--long-input", long_input]
        args += ["--truncation-side", side]
    process = start_server(args, tmp_path_factory.mktemp("prompt-logs"))
    yield process
    process.stop(signal.SIGTERM)


@pytest.fixture(scope="module")
def stub(server: ServerProcess) -> Iterator[pooling_pb2_grpc.PoolingServiceStub]:
    with grpc.insecure_channel(server.address) as channel:
        yield pooling_pb2_grpc.PoolingServiceStub(channel)


@pytest.fixture(scope="module")
def st_models(folders: dict[str, Path]) -> dict[str, SentenceTransformer]:
    names = ("prompts", "exclude-mean", "exclude-cls")
    return {name: SentenceTransformer(str(folders[name]), device="cpu") for name in names}


def pool(stub: pooling_pb2_grpc.PoolingServiceStub, **fields: object) -> pb.PoolResponse:
    return stub.Pool(pb.PoolRequest(**fields), timeout=60)


def embed(
    stub: pooling_pb2_grpc.PoolingServiceStub, model: str, texts: list[str], **fields: object
) -> np.ndarray:
    response = pool(stub, model=model, embed=pb.TextInput(texts=texts), **fields)
    return np.array([list(e.values) for e in response.embed.embeddings])


def fail(stub: pooling_pb2_grpc.PoolingServiceStub, **fields: object) -> DecodedError:
    with pytest.raises(grpc.RpcError) as caught:
        pool(stub, **fields)
    return decode_rpc_error(caught.value)


def close(got: np.ndarray, expected: np.ndarray) -> None:
    np.testing.assert_allclose(got, expected, rtol=0, atol=ATOL)


# ---------------------------------------------------------------------------------------------
# prompts: parity
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt_name", ["query", "passage", "instruct"])
def test_embed_prompt_name_matches_sentence_transformers(
    stub: pooling_pb2_grpc.PoolingServiceStub,
    st_models: dict[str, SentenceTransformer],
    prompt_name: str,
) -> None:
    expected = st_models["prompts"].encode(TEXTS, prompt_name=prompt_name)
    close(embed(stub, "prompts", TEXTS, prompt_name=prompt_name), expected)


def test_default_prompt_name_applies_when_the_request_names_none(
    stub: pooling_pb2_grpc.PoolingServiceStub, st_models: dict[str, SentenceTransformer]
) -> None:
    st = st_models["prompts"]
    assert st.default_prompt_name == "query"
    close(embed(stub, "prompts", TEXTS), st.encode(TEXTS))  # the folder's default: query
    close(embed(stub, "prompts-passage", TEXTS), st.encode(TEXTS, prompt_name="passage"))
    close(embed(stub, "prompts-none", TEXTS), st.encode(TEXTS, prompt=""))  # '' : none


def test_raw_prompt_matches_sentence_transformers(
    stub: pooling_pb2_grpc.PoolingServiceStub, st_models: dict[str, SentenceTransformer]
) -> None:
    st = st_models["prompts"]
    for prompt in ("Instruct: find the answer\nQuery: ", ""):
        close(embed(stub, "prompts", TEXTS, prompt=prompt), st.encode(TEXTS, prompt=prompt))


@pytest.mark.parametrize("name", ["exclude-mean", "exclude-cls"])
def test_include_prompt_false_leaves_prompt_tokens_out_of_the_pooling(
    stub: pooling_pb2_grpc.PoolingServiceStub,
    st_models: dict[str, SentenceTransformer],
    name: str,
) -> None:
    st = st_models[name]
    assert st[1].include_prompt is False
    for prompt_name in ("query", "instruct"):
        expected = st.encode(TEXTS, prompt_name=prompt_name)
        close(embed(stub, name, TEXTS, prompt_name=prompt_name), expected)
        # Not the same as pooling the prompt's tokens too.
        prompted = [PROMPTS[prompt_name] + text for text in TEXTS]
        assert not np.allclose(expected, st.encode(prompted, prompt=""), atol=ATOL)
    close(embed(stub, name, TEXTS), st.encode(TEXTS, prompt=""))  # no prompt: nothing left out


def test_token_embed_prepends_the_prompt(
    stub: pooling_pb2_grpc.PoolingServiceStub, st_models: dict[str, SentenceTransformer]
) -> None:
    st = st_models["prompts"]
    tokenizer = st.tokenizer
    response = pool(
        stub,
        model="prompts",
        token_embed=pb.TextInput(texts=TEXTS),
        prompt_name="instruct",
        params=pb.PoolingParams(use_activation=False),
    )
    expected = st.encode(TEXTS, prompt_name="instruct", output_value="token_embeddings")
    for item, rows, text in zip(response.token_embed.items, expected, TEXTS, strict=True):
        assert list(item.token_ids) == tokenizer(PROMPTS["instruct"] + text)["input_ids"]
        values = np.array(item.values).reshape(item.rows, item.cols)
        close(values, rows.numpy())


def test_embed_sparse_prepends_the_prompt(
    stub: pooling_pb2_grpc.PoolingServiceStub, folders: dict[str, Path]
) -> None:
    encoder = SparseEncoder(str(folders["sparse"]), device="cpu")
    assert PROMPTS.items() <= encoder.prompts.items()  # it adds an empty document prompt
    for fields, kwargs in (({"prompt_name": "query"}, {"prompt_name": "query"}), ({}, {})):
        response = pool(
            stub, model="sparse-prompts", embed_sparse=pb.SparseInput(texts=TEXTS), **fields
        )
        expected = encoder.encode(TEXTS, convert_to_tensor=True, **kwargs).to_dense().numpy()
        got = np.zeros_like(expected)
        for row, item in zip(got, response.embed_sparse.embeddings, strict=True):
            row[list(item.indices)] = list(item.values)
        close(got, expected)


def test_usage_counts_the_prompt_tokens(stub: pooling_pb2_grpc.PoolingServiceStub) -> None:
    plain = pool(stub, model="prompts", embed=pb.TextInput(texts=TEXTS), prompt="")
    prompted = pool(stub, model="prompts", embed=pb.TextInput(texts=TEXTS), prompt_name="passage")
    # "passage: " is two tokens ("passage", ":").
    assert prompted.usage.prompt_tokens == plain.usage.prompt_tokens + 2 * len(TEXTS)


# ---------------------------------------------------------------------------------------------
# prompts: validation
# ---------------------------------------------------------------------------------------------


def test_prompt_name_and_prompt_together_are_refused(
    stub: pooling_pb2_grpc.PoolingServiceStub,
) -> None:
    error = fail(
        stub, model="prompts", embed=pb.TextInput(texts=["a"]), prompt_name="query", prompt="q: "
    )
    assert (error.code, error.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "PROMPT_CONFLICT")
    assert error.fields == ["prompt"]


def test_unknown_prompt_name_lists_the_models_prompts(
    stub: pooling_pb2_grpc.PoolingServiceStub,
) -> None:
    error = fail(stub, model="prompts", embed=pb.TextInput(texts=["a"]), prompt_name="qeury")
    assert (error.code, error.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "PROMPT_NAME_UNKNOWN")
    assert error.fields == ["prompt_name"]
    description = error.description("prompt_name")
    assert '"qeury"' in description
    for name in PROMPTS:
        assert f'"{name}"' in description


@pytest.mark.parametrize(
    ("model", "case", "field"),
    [
        ("classifier-truncate", {"classify": pb.TextInput(texts=["a"])}, "prompt_name"),
        ("cross-truncate", {"score": pb.ScoreInput(text_1=["q"], text_2=["d"])}, "prompt"),
        ("prompts", {"score": pb.ScoreInput(text_1=["q"], text_2=["d"])}, "prompt_name"),
    ],
)
def test_prompts_are_refused_where_they_do_not_apply(
    stub: pooling_pb2_grpc.PoolingServiceStub, model: str, case: dict[str, object], field: str
) -> None:
    prompt = {"prompt_name": "query"} if field == "prompt_name" else {"prompt": "query: "}
    error = fail(stub, model=model, **case, **prompt)
    assert (error.code, error.reason) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "PROMPT_NOT_SUPPORTED_FOR_TASK",
    )
    assert error.fields == [field]


def test_list_models_shows_prompts_and_model_facts(
    stub: pooling_pb2_grpc.PoolingServiceStub,
) -> None:
    response = stub.ListModels(pb.ListModelsRequest(), timeout=30)
    cards = {card.name: card for card in response.models}
    assert response.server_version == version("pooling-server")
    assert dict(cards["prompts"].prompts) == PROMPTS
    assert cards["prompts"].default_prompt_name == "query"
    assert cards["prompts-passage"].default_prompt_name == "passage"
    assert cards["prompts-none"].default_prompt_name == ""
    assert dict(cards["cross-truncate"].prompts) == {}
    assert cards["truncate"].long_input == "truncate"
    for card in cards.values():
        assert (card.dtype, card.device, card.revision) == ("float32", "cpu", "")


# ---------------------------------------------------------------------------------------------
# --long-input truncate
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "side"), [("truncate", "right"), ("truncate-left", "left")])
def test_truncate_embed_matches_sentence_transformers(
    stub: pooling_pb2_grpc.PoolingServiceStub,
    st_models: dict[str, SentenceTransformer],
    name: str,
    side: str,
) -> None:
    st = st_models["prompts"]
    assert st.max_seq_length == MAX_POSITIONS
    st.tokenizer.truncation_side = side
    try:
        expected = st.encode(LONG_TEXTS, prompt="")
        with_prompt = st.encode(LONG_TEXTS, prompt_name="query")
    finally:
        st.tokenizer.truncation_side = "right"
    response = pool(stub, model=name, embed=pb.TextInput(texts=LONG_TEXTS))
    close(np.array([list(e.values) for e in response.embed.embeddings]), expected)
    close(embed(stub, name, LONG_TEXTS, prompt_name="query"), with_prompt)
    # Usage: the tokens actually used, at most the maximum per text.
    lengths = [min(len(st.tokenizer(t)["input_ids"]), MAX_POSITIONS) for t in LONG_TEXTS]
    assert response.usage.prompt_tokens == sum(lengths) == 128 + 4 + 128 + 128


def test_truncate_token_embed_keeps_the_maximum(
    stub: pooling_pb2_grpc.PoolingServiceStub, st_models: dict[str, SentenceTransformer]
) -> None:
    tokenizer = st_models["prompts"].tokenizer
    response = pool(stub, model="truncate", token_embed=pb.TextInput(texts=[LONG_TEXT]))
    (item,) = response.token_embed.items
    expected = tokenizer(LONG_TEXT, truncation=True, max_length=MAX_POSITIONS)["input_ids"]
    assert list(item.token_ids) == expected
    assert response.usage.prompt_tokens == MAX_POSITIONS


@pytest.mark.parametrize(
    ("name", "side"), [("cross-truncate", "right"), ("cross-truncate-left", "left")]
)
def test_truncate_cross_encoder_matches_sentence_transformers(
    stub: pooling_pb2_grpc.PoolingServiceStub, folders: dict[str, Path], name: str, side: str
) -> None:
    cross = CrossEncoder(str(folders["cross"]), device="cpu", max_length=MAX_POSITIONS)
    cross.tokenizer.truncation_side = side
    query = "what is the capital of france?"
    expected = cross.predict([(query, doc) for doc in LONG_TEXTS])
    response = pool(stub, model=name, score=pb.ScoreInput(text_1=[query], text_2=LONG_TEXTS))
    close(np.array(response.score.scores), expected)
    assert response.usage.prompt_tokens <= MAX_POSITIONS * len(LONG_TEXTS)


def test_truncate_classifier_matches_transformers(
    stub: pooling_pb2_grpc.PoolingServiceStub, folders: dict[str, Path]
) -> None:
    folder = folders["classifier"]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    response = pool(stub, model="classifier-truncate", classify=pb.TextInput(texts=LONG_TEXTS))
    for text, item in zip(LONG_TEXTS, response.classify.classifications, strict=True):
        inputs = tokenizer(text, truncation=True, max_length=MAX_POSITIONS, return_tensors="pt")
        with torch.inference_mode():
            probs = model(**inputs).logits.softmax(-1)[0].numpy()
        close(np.array(item.probs), probs)


def test_truncate_model_takes_texts_a_reject_model_refuses(
    stub: pooling_pb2_grpc.PoolingServiceStub,
) -> None:
    """Truncation may rightly run long: the character bound is the long one."""
    very_long = "word " * 4000  # 20,000 characters: over 64 per token of 128, under 1024
    response = pool(stub, model="truncate", embed=pb.TextInput(texts=[very_long]))
    assert response.usage.prompt_tokens == MAX_POSITIONS
    error = fail(stub, model="prompts-none", embed=pb.TextInput(texts=[LONG_TEXT]))
    assert (error.reason, error.fields) == ("INPUT_TOO_LONG", ["embed.texts[0]"])


# ---------------------------------------------------------------------------------------------
# the Python clients
# ---------------------------------------------------------------------------------------------


def test_python_client_embed_passes_prompts(
    server: ServerProcess, st_models: dict[str, SentenceTransformer]
) -> None:
    st = st_models["prompts"]
    with PoolingClient(server.address, model="prompts", timeout=60) as client:
        by_name = client.embed(TEXTS, prompt_name="passage")
        by_text = client.embed(TEXTS, prompt="custom: ")
        default = client.embed(TEXTS)
        card = next(m for m in client.models() if m.name == "prompts")
        with pytest.raises(ValueError, match="not both"):
            client.embed(TEXTS, prompt_name="query", prompt="q: ")
    assert (card.prompts, card.default_prompt_name) == (PROMPTS, "query")
    assert (card.dtype, card.device, card.revision) == ("float32", "cpu", "")
    close(np.array([o.outputs.embedding for o in by_name]), st.encode(TEXTS, prompt_name="passage"))
    close(np.array([o.outputs.embedding for o in by_text]), st.encode(TEXTS, prompt="custom: "))
    close(np.array([o.outputs.embedding for o in default]), st.encode(TEXTS))


async def _async_embed(address: str) -> list[list[float]]:
    async with AsyncPoolingClient(address, model="prompts", timeout=60) as client:
        outputs = await client.embed(TEXTS, prompt_name="instruct")
    return [o.outputs.embedding for o in outputs]


def test_async_client_embed_passes_prompts(
    server: ServerProcess, st_models: dict[str, SentenceTransformer]
) -> None:
    got = asyncio.run(_async_embed(server.address))
    close(np.array(got), st_models["prompts"].encode(TEXTS, prompt_name="instruct"))


def test_python_client_encode_and_embed_sparse_pass_prompts(
    server: ServerProcess,
    stub: pooling_pb2_grpc.PoolingServiceStub,
    st_models: dict[str, SentenceTransformer],
) -> None:
    st = st_models["prompts"]
    with PoolingClient(server.address, timeout=60) as client:
        rows = client.encode(
            TEXTS,
            model="prompts",
            pooling_task="token_embed",
            prompt_name="instruct",
            pooling_params=PoolingParams(use_activation=False),
        )
        sparse = client.embed_sparse(TEXTS, model="sparse-prompts", prompt_name="query")
        with pytest.raises(ValueError, match="not token_classify"):
            client.encode(TEXTS, model="prompts", pooling_task="token_classify", prompt="q: ")
    expected = st.encode(TEXTS, prompt_name="instruct", output_value="token_embeddings")
    for output, want in zip(rows, expected, strict=True):
        close(np.array(output.outputs.data), want.numpy())
    raw = pool(
        stub,
        model="sparse-prompts",
        embed_sparse=pb.SparseInput(texts=TEXTS),
        prompt_name="query",
    )
    for output, item in zip(sparse, raw.embed_sparse.embeddings, strict=True):
        assert list(output.outputs.indices) == list(item.indices)
        np.testing.assert_allclose(output.outputs.values, list(item.values), rtol=1e-6)
