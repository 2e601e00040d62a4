"""The ONNX Runtime and OpenVINO backends in-process: parity with torch for every head,
int8 quality on MiniLM, the export cache, shipped exports, and the load errors.

Exports go to a module-scoped cache, so each tiny model is exported once per backend.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pooling_server.engine.backends import BackendKind, BackendOptions, Quantize, RuntimeSettings
from pooling_server.engine.backends.select import EVENTS
from pooling_server.engine.models.loader import LoadedModel, load_model
from pooling_server.engine.models.model_info import HeadKind, PoolingType
from pooling_server.engine.models.model_runner import ThreadShare
from pooling_server.engine.models.model_spec import ModelSpec
from tests.fixture_models import MINILM, _bert_config, _save

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "Ünïcödé façade: naïve café, Straße, 東京タワー and an emoji 🙂",
    " ".join(["the powerhouse of the cell is the mitochondria"] * 6),
    "x",
]
FP32_COSINE = 0.9999
BACKENDS = [BackendKind.ONNX, BackendKind.OPENVINO]
# (fixture folder, pooling) for each head kind; the decoder has no token types.
MODELS = {
    "tiny-st-mean": (HeadKind.HIDDEN, None),
    "tiny-decoder": (HeadKind.HIDDEN, None),
    "tiny-cross-encoder": (HeadKind.SEQUENCE, None),
    "tiny-classifier": (HeadKind.SEQUENCE, None),
    "tiny-ner": (HeadKind.TOKEN, None),
    "tiny-mlm": (HeadKind.TOKEN, PoolingType.SPLADE),
}


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> RuntimeSettings:
    return RuntimeSettings(cache_dir=tmp_path_factory.mktemp("backend-cache"))


@pytest.fixture(scope="module")
def folders(model_folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    from transformers import AutoTokenizer, BertForMaskedLM

    torch.manual_seed(0)
    mlm = BertForMaskedLM(_bert_config())
    with torch.no_grad():
        mlm.cls.predictions.bias.fill_(-0.35)
    root = tmp_path_factory.mktemp("backend-models")
    mlm.save_pretrained(root / "tiny-mlm")
    AutoTokenizer.from_pretrained(MINILM).save_pretrained(root / "tiny-mlm")
    return {**model_folders, "tiny-mlm": root / "tiny-mlm"}


def load(
    folder: Path,
    kind: BackendKind,
    runtime: RuntimeSettings | None = None,
    pooling: PoolingType | None = None,
    **options: object,
) -> LoadedModel:
    spec = ModelSpec(
        str(folder),
        name=folder.name,
        pooling_type=pooling,
        backend=BackendOptions(kind, **options),  # type: ignore[arg-type]
    )
    return load_model(
        spec, device=torch.device("cpu"), dtype=torch.float32, runtime=runtime, threads=1
    )


def outputs(model: LoadedModel, keep_tokens: bool) -> list[np.ndarray]:
    batch = model.tokenizer.tokenize(TEXTS)
    return model.runner.forward(batch, [keep_tokens] * len(batch))


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.parametrize("kind", BACKENDS)
@pytest.mark.parametrize("name", list(MODELS))
def test_every_head_matches_torch(
    name: str, kind: BackendKind, folders: dict, cache: RuntimeSettings
) -> None:
    head, pooling = MODELS[name]
    reference = load(folders[name], BackendKind.TORCH, pooling=pooling)
    model = load(folders[name], kind, cache, pooling=pooling)
    assert model.info.backend == kind and model.info.precision == "float32"
    assert model.info.head is head and model.runner.module is None
    for keep in (False, True) if head is HeadKind.HIDDEN else (False,):
        got, want = outputs(model, keep), outputs(reference, keep)
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape
            assert cosine(g, w) >= FP32_COSINE
            np.testing.assert_allclose(g, w, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("kind", BACKENDS)
def test_passes_side_by_side_run_on_their_share_of_the_threads(
    kind: BackendKind, folders: dict, cache: RuntimeSettings
) -> None:
    """A lone pass takes every thread; passes beside another get a second session (ONNX
    Runtime) or compilation with a stream per share (OpenVINO), made once, and the same
    outputs."""
    folder = folders["tiny-st-mean"]
    reference = load(folder, BackendKind.TORCH)
    spec = ModelSpec(str(folder), name=folder.name, backend=BackendOptions(kind))
    model = load_model(
        spec, device=torch.device("cpu"), dtype=torch.float32, runtime=cache, threads=2
    )
    model.runner.threads = ThreadShare(alone=2, shared=1)
    batch = model.tokenizer.tokenize(TEXTS)
    want = reference.runner.forward(batch, [False] * len(batch))
    for alone in (True, False, False):
        got = model.runner.forward(batch, [False] * len(batch), alone)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-3, atol=1e-4)
    by_share: Any = model.runner.backend.by_share  # type: ignore[union-attr]
    assert sorted(by_share.made) == [1, 2]
    shared = by_share.made[1]
    if kind is BackendKind.OPENVINO:
        assert shared.get_property("NUM_STREAMS") == 2
        assert by_share.whole.get_property("NUM_STREAMS") == 1
    else:
        threads = {
            share: s.get_session_options().intra_op_num_threads
            for share, s in by_share.made.items()
        }
        assert threads == {1: 1, 2: 2} and by_share.whole is by_share.made[2]


RETRIEVAL = {
    "How do I bake bread at home?": "Mix flour, water, yeast and salt, knead, let it rise, "
    "then bake the loaf in a hot oven.",
    "What causes the seasons on Earth?": "The tilt of the Earth's axis changes how directly "
    "sunlight falls on each hemisphere over the year.",
    "Which language do people speak in Brazil?": "Portuguese is the official and most widely "
    "spoken language of Brazil.",
    "How can I speed up my laptop?": "Close background programs, add memory and replace the "
    "hard disk with a solid-state drive.",
    "Why do cats purr?": "Cats purr when content, and also to soothe themselves when hurt.",
    "When was the printing press invented?": "Gutenberg built his movable-type press in "
    "Mainz around 1440.",
}


@pytest.mark.parametrize(
    ("kind", "calibration"), [(BackendKind.ONNX, False), (BackendKind.OPENVINO, True)]
)
def test_int8_stays_close_and_ranks_the_same(
    kind: BackendKind, calibration: bool, cache: RuntimeSettings, tmp_path: Path
) -> None:
    """Mean cosine 0.99 to torch fp32 on MiniLM, and the same top-1 document per query."""
    options: dict[str, object] = {"quantize": Quantize.INT8}
    if calibration:  # a short file keeps nncf's calibration cheap
        from pooling_server.engine.backends import CALIBRATION_FILE

        lines = CALIBRATION_FILE.read_text().splitlines()[::6]
        (tmp_path / "calibration.txt").write_text("\n".join(lines))
        options["calibration_file"] = str(tmp_path / "calibration.txt")
    reference = load(MINILM, BackendKind.TORCH)
    model = load(MINILM, kind, cache, **options)
    assert model.info.precision == "int8"
    queries, documents = list(RETRIEVAL), list(RETRIEVAL.values())

    def embed(m: LoadedModel, texts: list[str]) -> np.ndarray:
        vectors = np.stack(m.runner.forward(m.tokenizer.tokenize(texts), [False] * len(texts)))
        return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)

    cosines = []
    for texts in (queries, documents):
        cosines += list((embed(model, texts) * embed(reference, texts)).sum(axis=1))
    assert np.mean(cosines) >= 0.99, cosines
    ranked = embed(model, queries) @ embed(model, documents).T
    assert list(ranked.argmax(axis=1)) == list(range(len(queries)))
    assert list((embed(reference, queries) @ embed(reference, documents).T).argmax(axis=1)) == list(
        range(len(queries))
    )


def test_a_second_load_uses_the_cache_and_a_changed_model_exports_again(
    model_folders: dict, tmp_path: Path
) -> None:
    folder = shutil.copytree(model_folders["tiny-bert"], tmp_path / "tiny-bert")
    runtime = RuntimeSettings(cache_dir=tmp_path / "cache")
    EVENTS.clear()
    first = load(folder, BackendKind.ONNX, runtime)
    second = load(folder, BackendKind.ONNX, runtime)
    assert EVENTS == [("tiny-bert", "export"), ("tiny-bert", "cache")]
    assert first.info.backend_file == second.info.backend_file
    config = json.loads((folder / "config.json").read_text())
    config["layer_norm_eps"] = 1e-5  # any change to the model's files
    (folder / "config.json").write_text(json.dumps(config))
    third = load(folder, BackendKind.ONNX, runtime)
    assert EVENTS[-1] == ("tiny-bert", "export")
    assert third.info.backend_file != first.info.backend_file


def test_a_shipped_export_loads_and_a_corrupt_one_names_its_file(
    model_folders: dict, cache: RuntimeSettings, tmp_path: Path
) -> None:
    exported = load(model_folders["tiny-bert"], BackendKind.ONNX, cache)
    folder = shutil.copytree(model_folders["tiny-bert"], tmp_path / "shipped")
    (folder / "onnx").mkdir()
    shutil.copy(exported.info.backend_file, folder / "onnx" / "model.onnx")
    EVENTS.clear()
    # auto with a file: the file's kind decides.
    shipped = load(folder, BackendKind.AUTO, file="onnx/model.onnx")
    assert EVENTS == [("shipped", "file")]
    assert shipped.info.backend == "onnx"
    assert shipped.info.backend_file == str(folder / "onnx" / "model.onnx")
    for got, want in zip(outputs(shipped, False), outputs(exported, False), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    (folder / "onnx" / "model.onnx").write_bytes(b"not a graph at all")
    with pytest.raises(ValueError, match=r"could not load .*shipped/onnx/model\.onnx"):
        load(folder, BackendKind.ONNX, file="onnx/model.onnx")
    (folder / "openvino").mkdir()
    (folder / "openvino" / "openvino_model.xml").write_text("<net>truncated")
    with pytest.raises(ValueError, match=r"openvino/openvino_model\.xml"):
        load(folder, BackendKind.OPENVINO, file="openvino/openvino_model.xml")
    with pytest.raises(ValueError, match="does not exist"):
        load(folder, BackendKind.ONNX, file="onnx/model_qint8_avx512_vnni.onnx")


def test_torch_and_quantize_do_not_mix(model_folders: dict) -> None:
    with pytest.raises(ValueError, match="--quantize int8 runs on --backend onnx or openvino"):
        load(model_folders["tiny-bert"], BackendKind.TORCH, quantize=Quantize.INT8)


MISSING = """
import sys, torch
sys.modules["openvino"] = None  # as if the package were not installed
from pooling_server.engine.backends import BackendKind, BackendOptions, RuntimeSettings
from pooling_server.engine.models.loader import load_model
from pooling_server.engine.models.model_runner import ThreadShare
from pooling_server.engine.models.model_spec import ModelSpec
def load(kind):
    spec = ModelSpec(sys.argv[1], name="tiny", backend=BackendOptions(kind))
    return load_model(spec, device=torch.device("cpu"), dtype=torch.float32,
                      runtime=RuntimeSettings(cache_dir=__import__("pathlib").Path(sys.argv[2])))
try:
    load(BackendKind.OPENVINO)
except ValueError as exc:
    print("ERROR:", exc)
print("AUTO:", load(BackendKind.AUTO).info.backend)
"""


def test_a_missing_package_is_a_clear_error_and_auto_moves_on(
    model_folders: dict, tmp_path: Path
) -> None:
    run = subprocess.run(
        [sys.executable, "-c", MISSING, str(model_folders["tiny-bert"]), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    error = next(line for line in run.stdout.splitlines() if line.startswith("ERROR:"))
    assert "model tiny" in error and "--backend openvino" in error
    assert "openvino package" in error and "--backend" in error.split("package")[-1]
    assert "AUTO: onnx" in run.stdout


# Data-dependent code outside torch in forward: no exporter can follow it.
UNEXPORTABLE = """
from transformers import BertConfig, BertModel


class TracedBadlyConfig(BertConfig):
    model_type = "traced-badly-bert"


class TracedBadlyModel(BertModel):
    config_class = TracedBadlyConfig

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, **kwargs):
        output = super().forward(
            input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
            **kwargs,
        )
        # Leaves the graph through numpy: a tracer records this batch's value as a constant.
        longest = float(attention_mask.detach().cpu().numpy().sum(axis=1).max())
        output.last_hidden_state = output.last_hidden_state + longest
        return output
"""


def test_auto_falls_back_to_torch_where_the_export_strays(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from transformers import BertModel

    folder = _save(BertModel(_bert_config()), tmp_path / "traced-badly")
    (folder / "modeling_traced.py").write_text(UNEXPORTABLE)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "traced-badly-bert"
    config["auto_map"] = {
        "AutoConfig": "modeling_traced.TracedBadlyConfig",
        "AutoModel": "modeling_traced.TracedBadlyModel",
    }
    (folder / "config.json").write_text(json.dumps(config))
    spec = ModelSpec(
        str(folder),
        name="traced-badly",
        trust_remote_code=True,
        backend=BackendOptions(BackendKind.AUTO),
    )
    with caplog.at_level(logging.WARNING, logger="pooling_server.engine.backends.select"):
        model = load_model(
            spec,
            device=torch.device("cpu"),
            dtype=torch.float32,
            runtime=RuntimeSettings(cache_dir=tmp_path / "cache"),
        )
    assert model.info.backend == "torch" and model.runner.module is not None
    assert "falls back to torch" in caplog.text and "strays from torch" in caplog.text


def test_auto_takes_openvino_bfloat16_only_where_the_cpu_has_it_and_the_check_holds(
    folders: dict, cache: RuntimeSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU's bfloat16 is stood in for by openvino_backend.bf16_native, so that every host
    runs every branch (OpenVINO falls back to float32 where the CPU lacks it). The model is
    compiled once at start-up in the precision it runs, twice only where bfloat16 fails."""
    from pooling_server.engine.backends import openvino_backend
    from pooling_server.engine.backends.openvino_backend import OpenVinoBackend

    built: list[bool] = []  # each OpenVinoBackend made: bfloat16 or not
    init = OpenVinoBackend.__init__

    def counting(self: OpenVinoBackend, *args: object, bf16: bool = False) -> None:
        built.append(bf16)
        init(self, *args, bf16=bf16)  # type: ignore[arg-type]

    monkeypatch.setattr(OpenVinoBackend, "__init__", counting)
    folder = folders["tiny-st-mean"]
    reference = load(folder, BackendKind.TORCH)
    monkeypatch.setattr(openvino_backend, "bf16_native", lambda: False)
    assert load(folder, BackendKind.AUTO, cache).info.precision == "float32"
    assert built == [False]

    built.clear()
    monkeypatch.setattr(openvino_backend, "bf16_native", lambda: True)
    model = load(folder, BackendKind.AUTO, cache)
    assert (model.info.backend, model.info.precision) == ("openvino", "bfloat16")
    assert built == [True]  # no float32 compilation on the way
    for keep in (False, True):  # the float32 rule holds on every output
        for got, want in zip(outputs(model, keep), outputs(reference, keep), strict=True):
            assert got.shape == want.shape and cosine(got, want) >= FP32_COSINE
    # Asked for by name, OpenVINO stays float32.
    assert load(folder, BackendKind.OPENVINO, cache).info.precision == "float32"

    # A model that loses too much in bfloat16 (noise on its outputs stands in for one):
    # `auto` then compiles the same file in float32, which passes.
    run = OpenVinoBackend.run

    def strays(self: OpenVinoBackend, inputs: dict, threads: int | None = None) -> np.ndarray:
        output = run(self, inputs, threads)
        if self.precision != "bfloat16":
            return output
        return output + np.random.default_rng(0).standard_normal(output.shape).astype(np.float32)

    monkeypatch.setattr(OpenVinoBackend, "run", strays)
    built.clear()
    fallback = load(folder, BackendKind.AUTO, cache)
    assert (fallback.info.backend, fallback.info.precision) == ("openvino", "float32")
    assert built == [True, False]


def test_exports_run_float32_on_the_cpu_and_auto_runs_torch_elsewhere(
    model_folders: dict, caplog: pytest.LogCaptureFixture
) -> None:
    """What runs where is each backend's own fact: an export asked for in bfloat16 is
    refused naming the flags; `auto` runs torch in the dtype asked for, saying that
    --quantize is ignored there."""
    from pooling_server.engine.backends.torch_backend import TorchBackend

    folder = model_folders["tiny-bert"]

    def bfloat16(kind: BackendKind, **options: object) -> LoadedModel:
        spec = ModelSpec(str(folder), name="tiny", backend=BackendOptions(kind, **options))  # type: ignore[arg-type]
        return load_model(spec, device=torch.device("cpu"), dtype=torch.bfloat16)

    with pytest.raises(ValueError, match="--backend onnx runs float32 on the CPU, not bfloat16"):
        bfloat16(BackendKind.ONNX)
    with caplog.at_level(logging.WARNING, logger="pooling_server.engine.backends.select"):
        model = bfloat16(BackendKind.AUTO, quantize=Quantize.INT8)
    assert (model.info.backend, model.info.precision, model.info.backend_file) == (
        "torch",
        "bfloat16",
        "",
    )
    assert "--quantize int8 ignored" in caplog.text
    assert isinstance(model.runner.backend, TorchBackend)
    assert model.runner.module is model.runner.backend.module


def test_a_backend_file_is_a_backend_s_by_its_ending(model_folders: dict) -> None:
    folder = model_folders["tiny-bert"]
    with pytest.raises(ValueError, match=r"neither an ONNX file \(\.onnx\) nor an OpenVINO"):
        load(folder, BackendKind.AUTO, file="model.safetensors")
    with pytest.raises(ValueError, match=r"--backend-file onnx/model\.onnx is not a openvino file"):
        load(folder, BackendKind.OPENVINO, file="onnx/model.onnx")
