"""PoolingStage on a real local Ray: each task's Arrow columns equal the in-process batch job's
answers (or, where no batch route carries the task, the engine's), a bad row is an error on
that row alone, the columns write to Parquet as they are, and client mode calls a real server
with two front ends."""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image as PILImage

from pooling_server.engine.requests.params import Task
from pooling_server.engine.requests.request import Audio, Image, PoolRequest
from pooling_server.service.batch_job import LineRunner, answer_lines, new_runner
from pooling_server.service.loading import load_engine
from pooling_server.service.ray_stage import PoolingStage, pool_dataset, server_config
from tests.audio_clips import clip
from tests.fixture_models import tiny_clap, tiny_clip, tiny_colbert, tiny_mlm
from tests.server_process import ServerProcess, running_server
from tests.service.ray_cluster import CPU_PER_ACTOR, ray, start_cluster

TEXTS = ["a cat sat on the mat", "quantum chromodynamics", "ünïcödé façade 東京", "x " * 40]
TORCH = ["--backend", "torch", "--dtype", "float32"]


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    yield from start_cluster()


@pytest.fixture(scope="module")
def folders(model_folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("ray-stage-models")
    return {
        **model_folders,
        "colbert": tiny_colbert(root / "colbert"),
        "clip": tiny_clip(root / "clip"),
        "clap": tiny_clap(root / "clap"),
        "tiny-mlm": tiny_mlm(root / "tiny-mlm"),
    }


def staged(rows: list[dict[str, Any]], **stage: Any) -> list[dict[str, Any]]:
    """Rows through one actor of PoolingStage, back in order."""
    dataset = ray.data.from_items(rows)
    out = pool_dataset(dataset, actors=1, num_cpus=CPU_PER_ACTOR, batch_size=3, **stage)
    return [row for table in ray.get(out.to_arrow_refs()) for row in table.to_pylist()]


class Reference:
    """The answers in this process: batch lines through the batch job's LineRunner, or the
    engine's own results."""

    def __init__(self, args: list[str]) -> None:
        self.engine = load_engine(server_config(args))

    async def _lines(self, bodies: list[tuple[str, dict]]) -> list[dict]:
        await self.engine.start()
        try:
            lines = LineRunner(new_runner(self.engine))
            raws = [
                json.dumps(
                    {"custom_id": str(k), "method": "POST", "url": url, "body": body}
                ).encode()
                for k, (url, body) in enumerate(bodies)
            ]
            return [json.loads(line) for line in await answer_lines(lines, raws, 1)]
        finally:
            await self.engine.stop()

    def lines(self, bodies: list[tuple[str, dict]]) -> list[dict]:
        return asyncio.run(self._lines(bodies))

    def pool(self, request: PoolRequest) -> Any:
        async def run() -> Any:
            await self.engine.start()
            try:
                return await self.engine.pool(request)
            finally:
                await self.engine.stop()

        return asyncio.run(run())


def body_of(answer: dict) -> dict:
    assert answer["response"]["status_code"] == 200, answer
    return answer["response"]["body"]


def test_embed_with_dimensions_and_float16_equals_the_batch_job(
    cluster: str, folders: dict
) -> None:
    args = ["--model", str(folders["tiny-st-mean"]), *TORCH]
    args += ["--hf-overrides", '{"is_matryoshka": true}']
    rows = [{"text": t, "doc_id": k} for k, t in enumerate(TEXTS)]
    got = staged(rows, server_args=args, task="embed", dimensions=16)
    half = staged(rows, server_args=args, task="embed", dimensions=16, encoding="float16")
    ref = Reference(args).lines([("/v1/embeddings", {"input": t, "dimensions": 16}) for t in TEXTS])
    for row, low, answer in zip(got, half, ref, strict=True):
        want = np.asarray(body_of(answer)["data"][0]["embedding"], np.float32)
        assert (
            want.shape == (16,)
            and row["error"] is None
            and row["doc_id"] == TEXTS.index(row["text"])
        )
        np.testing.assert_allclose(row["embedding"], want, atol=1e-6)
        np.testing.assert_array_equal(
            np.asarray(low["embedding"], np.float16), want.astype(np.float16)
        )


def test_classify_score_and_rerank_equal_the_batch_job(cluster: str, folders: dict) -> None:
    args = ["--model", f"cls={folders['tiny-classifier']}"]
    args += ["--model", f"ce={folders['tiny-cross-encoder']}", *TORCH]
    classified = staged(
        [{"text": t} for t in TEXTS], server_args=args, task="classify", model="cls"
    )
    pairs = [{"text_1": t, "text_2": TEXTS[-1 - k]} for k, t in enumerate(TEXTS)]
    scored = staged(pairs, server_args=args, task="score", model="ce")
    reranks = [{"query": t, "documents": TEXTS} for t in TEXTS[:2]]
    ranked = staged(reranks, server_args=args, task="rerank", model="ce", top_n=3)
    ref = Reference(args).lines(
        [("/classify", {"model": "cls", "input": [t]}) for t in TEXTS]
        + [
            ("/v1/score", {"model": "ce", "text_1": p["text_1"], "text_2": p["text_2"]})
            for p in pairs
        ]
        + [("/v1/rerank", {"model": "ce", "top_n": 3, **r}) for r in reranks]
    )
    for row, answer in zip(classified, ref[:4], strict=True):
        data = body_of(answer)["data"][0]
        np.testing.assert_allclose(row["probs"], data["probs"], atol=1e-6)
        assert row["label"] == data["label"]
    for row, answer in zip(scored, ref[4:8], strict=True):
        assert row["score"] == pytest.approx(body_of(answer)["data"][0]["score"], abs=1e-6)
    for row, answer in zip(ranked, ref[8:], strict=True):
        results = body_of(answer)["results"]
        assert [r["index"] for r in row["ranking"]] == [r["index"] for r in results]
        scores = [r["score"] for r in row["ranking"]]
        np.testing.assert_allclose(scores, [r["relevance_score"] for r in results], atol=1e-6)


def test_token_tasks_and_colbert_equal_the_batch_job(cluster: str, folders: dict) -> None:
    args = ["--model", f"ner={folders['tiny-ner']}", "--model", f"col={folders['colbert']}"]
    args += TORCH
    rows = [{"text": t} for t in TEXTS]
    tokens = staged(rows, server_args=args, task="token_classify", model="ner")
    multi = staged(rows, server_args=args, task="embed_multi", model="col")
    ref = Reference(args).lines(
        [("/pooling", {"model": "ner", "task": "token_classify", "input": [t]}) for t in TEXTS]
        + [("/pooling", {"model": "col", "task": "embed_multi", "input": [t]}) for t in TEXTS]
    )
    for row, answer in zip(tokens, ref[:4], strict=True):
        np.testing.assert_allclose(
            row["token_probs"], body_of(answer)["data"][0]["data"], atol=1e-6
        )
        assert len(row["token_labels"]) == len(row["token_probs"])
    for row, answer in zip(multi, ref[4:], strict=True):
        np.testing.assert_allclose(
            row["multi_vector"], body_of(answer)["data"][0]["data"], atol=1e-6
        )


def test_sparse_and_images_equal_the_engine(cluster: str, folders: dict) -> None:
    """embed_sparse and image inputs have no OpenAI batch route: the engine is the reference."""
    args = ["--model", str(folders["clip"]), *TORCH]
    images = []
    for shade in (0, 90, 200):
        buffer = io.BytesIO()
        PILImage.new("RGB", (40, 30), (shade, 255 - shade, 60)).save(buffer, format="PNG")
        images.append(buffer.getvalue())
    rows = [{"text": "a red square", "image": None}] + [{"text": None, "image": i} for i in images]
    got = staged(rows, server_args=args, task="embed", image_column="image")
    items = ("a red square", *(Image(i) for i in images))
    want = Reference(args).pool(PoolRequest(task=Task.EMBED, items=items))
    for row, output in zip(got, want.outputs, strict=True):
        assert row["error"] is None
        np.testing.assert_allclose(row["embedding"], output.values, atol=1e-6)

    splade = ["--model", str(folders["tiny-mlm"]), "--pooling-type", "splade", *TORCH]
    sparse = staged([{"text": t} for t in TEXTS], server_args=splade, task="embed_sparse")
    request = PoolRequest(task=Task.EMBED_SPARSE, texts=tuple(TEXTS))
    for row, output in zip(sparse, Reference(splade).pool(request).outputs, strict=True):
        assert row["sparse_indices"] == output.indices.tolist()
        np.testing.assert_allclose(row["sparse_values"], output.values, atol=1e-6)


def test_audio_bytes_are_sent_as_audio(cluster: str, folders: dict) -> None:
    """A media column's WAV, FLAC and OGG bytes reach a CLAP model as audio clips (by their
    signature, as the Python client tells them), not as images it would refuse."""
    args = ["--model", str(folders["clap"]), *TORCH]
    formats = ("WAV", "FLAC", "OGG")
    clips = [clip(fmt=fmt, frequency=220.0 * (k + 1)) for k, fmt in enumerate(formats)]
    rows = [{"text": "a low hum", "media": None}] + [{"text": None, "media": c} for c in clips]
    got = staged(rows, server_args=args, task="embed", image_column="media")
    items = ("a low hum", *(Audio(c) for c in clips))
    want = Reference(args).pool(PoolRequest(task=Task.EMBED, items=items))
    for row, output in zip(got, want.outputs, strict=True):
        assert row["error"] is None
        np.testing.assert_allclose(row["embedding"], output.values, atol=1e-6)


def test_a_stage_naming_a_repository_model_loads_it(
    cluster: str, folders: dict, tmp_path: Path
) -> None:
    """--model-repository: the actor loads the stage's model on its first batch, and its
    rows equal an engine given that model with --model."""
    repository = tmp_path / "models"
    repository.mkdir()
    (repository / "rep-st").symlink_to(folders["tiny-st-mean"], target_is_directory=True)
    args = ["--model", str(folders["tiny-bert"]), *TORCH, "--model-repository", str(repository)]
    got = staged([{"text": t} for t in TEXTS], server_args=args, task="embed", model="rep-st")
    given = ["--model", f"rep-st={folders['tiny-st-mean']}", *TORCH]
    want = Reference(given).pool(PoolRequest(task=Task.EMBED, texts=tuple(TEXTS)))
    for row, output in zip(got, want.outputs, strict=True):
        assert row["error"] is None, row
        np.testing.assert_allclose(row["embedding"], output.values, atol=1e-6)


def test_a_bad_row_is_an_error_on_that_row_and_parquet_takes_the_columns(
    cluster: str, folders: dict, tmp_path: Path
) -> None:
    args = ["--model", str(folders["tiny-st-mean"]), "--max-input-chars", "64", *TORCH]
    rows = [{"text": t} for t in ["fine", "y" * 500, None, "also fine", ""]]
    dataset = pool_dataset(
        ray.data.from_items(rows),
        actors=1,
        num_cpus=CPU_PER_ACTOR,
        batch_size=5,
        server_args=args,
        task="embed",
        dimensions=None,
    )
    dataset.write_parquet(str(tmp_path / "out"))
    table = pq.read_table(tmp_path / "out")
    kind = table.schema.field("embedding").type
    assert pa.types.is_fixed_size_list(kind) and kind.value_type == pa.float32(), kind
    by_text = {row["text"]: row for row in table.to_pylist()}
    assert by_text["fine"]["error"] is None and len(by_text["fine"]["embedding"]) > 0
    assert by_text["also fine"]["error"] is None
    assert by_text["y" * 500]["embedding"] is None
    assert (
        by_text["y" * 500]["error"].startswith("INPUT_TOO_LONG")
        or "long" in by_text["y" * 500]["error"].lower()
    ), by_text["y" * 500]["error"]
    assert by_text[None]["error"].startswith("INVALID_ROW")


def test_unknown_options_and_tasks_are_refused() -> None:
    with pytest.raises(TypeError, match="unknown PoolingStage options: colour"):
        PoolingStage(address="127.0.0.1:1", colour="red")
    with pytest.raises(ValueError, match="task must be one of"):
        PoolingStage(address="127.0.0.1:1", task="summarise")


@pytest.fixture(scope="module")
def fleet(folders: dict, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args = ["--model", str(folders["tiny-st-mean"]), "--frontends", "2", *TORCH]
    yield from running_server(args, tmp_path_factory.mktemp("ray-fleet"))


def test_client_mode_calls_a_fleet_with_two_front_ends(
    cluster: str, folders: dict, fleet: ServerProcess
) -> None:
    rows = [{"text": t} for t in TEXTS * 5] + [{"text": None}]
    got = staged(rows, address=f"127.0.0.1:{fleet.port}", task="embed", rows_per_request=4)
    args = ["--model", str(folders["tiny-st-mean"]), *TORCH]
    ref = Reference(args).pool(PoolRequest(task=Task.EMBED, texts=tuple(TEXTS)))
    for k, row in enumerate(got[:-1]):
        np.testing.assert_allclose(row["embedding"], ref.outputs[k % 4].values, atol=1e-5)
    assert got[-1]["embedding"] is None and got[-1]["error"].startswith("INVALID_ROW")
    refused = staged(rows[:2], address=f"127.0.0.1:{fleet.port}", task="embed", dimensions=8)
    assert all(row["embedding"] is None for row in refused)  # not a matryoshka model
    assert all("dimensions" in row["error"].lower() for row in refused), refused
