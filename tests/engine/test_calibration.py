"""int8/uint8 calibration ranges computed at load (engine/models/calibration.py) on real models:
equal to sentence-transformers' embeddings of the same calibration texts, min and max per
dimension (default prompt and normalisation included), read from the cache on a second
load without a forward pass, keyed by the texts, left alone where the folder ships ranges
or the head has no embeddings; and an int8 request's bytes do not depend on its batch."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.util.quantization import quantize_embeddings

import pooling_server.engine.models.calibration as calibration
from pooling_server.engine.backends import CALIBRATION_FILE, BackendOptions, RuntimeSettings
from pooling_server.engine.models.loader import LoadedModel, load_model
from pooling_server.engine.models.model_spec import ModelSpec
from pooling_server.engine.requests.encodings import encode, ranges_array
from pooling_server.engine.requests.params import OutputEncoding, Task
from pooling_server.engine.requests.plans import plan_request
from pooling_server.engine.requests.request import PoolRequest
from tests.fixture_models import MINILM, short_vocabulary_bert

CALIBRATION_TEXTS = [
    line.strip() for line in CALIBRATION_FILE.read_text().splitlines() if line.strip()
]


@pytest.fixture
def cache(tmp_path: Path) -> RuntimeSettings:
    return RuntimeSettings(cache_dir=tmp_path / "cache")


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """How many texts each ranges computation embedded (none: read from the cache)."""
    counted: list[int] = []
    embed = calibration.embed_texts

    def counting(model, forward, texts):  # type: ignore[no-untyped-def]
        counted.append(len(texts))
        return embed(model, forward, texts)

    monkeypatch.setattr(calibration, "embed_texts", counting)
    calibration.EVENTS.clear()
    yield counted


def load(folder: Path | str, cache: RuntimeSettings, **spec: object) -> LoadedModel:
    return load_model(
        ModelSpec(str(folder), **spec),  # type: ignore[arg-type]
        device=torch.device("cpu"),
        dtype=torch.float32,
        runtime=cache,
    )


def reference_ranges(folder: Path | str, texts: list[str]) -> np.ndarray:
    """Independently: sentence-transformers' embeddings of the texts, min and max per dim."""
    vectors = SentenceTransformer(str(folder), device="cpu").encode(texts, batch_size=32)
    return np.vstack([vectors.min(axis=0), vectors.max(axis=0)])


def test_ranges_computed_from_the_calibration_texts_then_read_from_the_cache(
    model_folders: dict[str, Path], cache: RuntimeSettings, calls: list[int]
) -> None:
    folder = model_folders["tiny-st-mean"]
    model = load(folder, cache)
    assert model.info.calibration_source == "computed"
    assert calls == [len(CALIBRATION_TEXTS)]
    ranges = np.array(model.info.calibration_ranges)
    assert ranges.shape == (2, model.info.hidden_size)
    np.testing.assert_allclose(ranges, reference_ranges(folder, CALIBRATION_TEXTS), atol=1e-5)
    assert (ranges[0] < ranges[1]).all()
    (cached,) = Path(cache.cache_dir).glob("ranges-*.json")  # type: ignore[arg-type]
    assert json.loads(cached.read_text())["texts"] == len(CALIBRATION_TEXTS)

    again = load(folder, cache)
    assert calls == [len(CALIBRATION_TEXTS)]  # no forward pass the second time
    events = calibration.EVENTS
    assert events == [(str(folder), "computed"), (str(folder), "cache")]
    assert again.info.calibration_ranges == model.info.calibration_ranges
    assert again.info.calibration_source == "computed"


def test_minilm_ranges_equal_sentence_transformers(
    cache: RuntimeSettings, calls: list[int]
) -> None:
    model = load(MINILM, cache)
    np.testing.assert_allclose(
        np.array(model.info.calibration_ranges),
        reference_ranges(MINILM, CALIBRATION_TEXTS),
        atol=1e-5,
    )
    again = load(MINILM, cache)
    assert again.info.calibration_ranges == model.info.calibration_ranges
    assert calls == [len(CALIBRATION_TEXTS)]


def test_default_prompt_and_calibration_file_shape_the_ranges(
    model_folders: dict[str, Path], cache: RuntimeSettings, calls: list[int], tmp_path: Path
) -> None:
    """The ranges are those of the vectors a request gets by default, the default prompt
    prepended; another --calibration-file is another cache entry."""
    folder = Path(shutil.copytree(model_folders["tiny-st-mean"], tmp_path / "prompted"))
    prompts = {"query": "query: ", "document": "passage: "}
    (folder / "config_sentence_transformers.json").write_text(
        json.dumps({"prompts": prompts, "default_prompt_name": "query"})
    )
    model = load(folder, cache)
    np.testing.assert_allclose(
        np.array(model.info.calibration_ranges),
        reference_ranges(folder, CALIBRATION_TEXTS),  # sentence-transformers prompts too
        atol=1e-5,
    )
    texts = [f"calibration sentence number {i} about topic {i % 7}" for i in range(40)]
    (tmp_path / "texts.txt").write_text("\n\n".join(texts))
    options = BackendOptions(calibration_file=str(tmp_path / "texts.txt"))
    other = load(folder, cache, backend=options)
    np.testing.assert_allclose(
        np.array(other.info.calibration_ranges), reference_ranges(folder, texts), atol=1e-5
    )
    assert calls == [len(CALIBRATION_TEXTS), len(texts)]


def test_shipped_ranges_win_and_classifiers_have_none(
    model_folders: dict[str, Path], cache: RuntimeSettings, calls: list[int], tmp_path: Path
) -> None:
    folder = Path(shutil.copytree(model_folders["tiny-bert"], tmp_path / "shipped"))
    shipped = np.vstack([-np.ones(32), np.ones(32)])
    np.save(folder / "calibration_ranges.npy", shipped)
    model = load(folder, cache)
    assert model.info.calibration_source == "folder"
    np.testing.assert_array_equal(model.info.calibration_ranges, shipped)
    classifier = load(model_folders["tiny-classifier"], cache)
    assert classifier.info.calibration_ranges is None
    assert classifier.info.calibration_source == ""
    assert calls == []


def test_int8_bytes_do_not_depend_on_the_batch(
    model_folders: dict[str, Path], cache: RuntimeSettings
) -> None:
    """The ranges are fixed at load: a text's int8 and uint8 bytes are the same alone and
    in a batch with longer texts, and are quantize_embeddings' with those ranges."""
    model = load(model_folders["tiny-st-mean"], cache)
    ranges = ranges_array(model.info.calibration_ranges)
    text = "Compact embeddings travel as packed bytes."
    others = ["a much longer text " * 8, "short", "another text of a middling length here"]

    def vectors(texts: list[str]) -> np.ndarray:
        plan = plan_request(PoolRequest(Task.EMBED, texts=tuple(texts)), model)
        raws = model.runner.forward([s for s, _ in plan.work], [k for _, k in plan.work])
        return np.stack([output.values for output in plan.finish(raws)])  # type: ignore[union-attr]

    alone, batched = vectors([text])[0], vectors([*others, text])[-1]
    for encoding in (OutputEncoding.INT8, OutputEncoding.UINT8):
        assert encode(alone, encoding, ranges) == encode(batched, encoding, ranges)
        expected = quantize_embeddings(alone[None], precision=str(encoding), ranges=ranges)
        assert encode(alone, encoding, ranges) == expected.tobytes()


def test_a_model_that_fails_on_the_calibration_texts_still_loads(
    tmp_path: Path, cache: RuntimeSettings, caplog: pytest.LogCaptureFixture
) -> None:
    """Its vocabulary ends before ids the texts use (its warm-up text stays within it): it
    serves what it can, with int8/uint8 refused as for a model without ranges."""
    folder = short_vocabulary_bert(tmp_path / "short-vocabulary")
    with caplog.at_level("WARNING"):
        model = load(folder, cache)
    assert model.info.calibration_ranges is None
    assert model.info.calibration_source == ""
    assert "calibration texts failed" in caplog.text
