"""sentence-transformers folders with Dense modules (LaBSE, distiluse and the like): the
server projects the pooled vector as `encode` does, on a real server."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.modules import (
    Dense,
    Normalize,
    Pooling,
    Transformer,
)

from pooling_client import PoolingClient
from tests.server_process import ServerProcess, start_server

TEXTS = ["a projected sentence", "another one, somewhat longer than the first", "x"]


def _save(base: Path, target: Path, dense: list[Dense], normalize: bool) -> Path:
    transformer = Transformer(str(base))
    width = transformer.get_embedding_dimension()
    modules = [transformer, Pooling(width, pooling_mode="mean"), *dense]
    if normalize:
        modules.append(Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(str(target))
    return target


@pytest.fixture(scope="module")
def folders(
    model_folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    torch.manual_seed(3)
    root = tmp_path_factory.mktemp("dense")
    base = model_folders["tiny-bert"]
    width = Transformer(str(base)).get_embedding_dimension()
    return {
        "tanh": _save(base, root / "tanh", [Dense(width, 16)], normalize=True),
        "stacked": _save(
            base,
            root / "stacked",
            [
                Dense(width, 24, activation_function=torch.nn.GELU()),
                Dense(24, 24, activation_function=None, use_residual=True),
                Dense(24, 8, bias=False, activation_function=torch.nn.Identity()),
            ],
            normalize=False,
        ),
    }


@pytest.fixture(scope="module")
def server(
    folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    args = ["--dtype", "float32"]
    for name, folder in folders.items():
        args += ["--model", f"{name}={folder}"]
    process = start_server(args, tmp_path_factory.mktemp("dense-logs"))
    yield process
    process.stop(signal.SIGTERM)


@pytest.mark.parametrize("name", ["tanh", "stacked"])
def test_dense_projection_matches_sentence_transformers(
    server: ServerProcess, folders: dict[str, Path], name: str
) -> None:
    reference = SentenceTransformer(str(folders[name]), device="cpu")
    expected = reference.encode(TEXTS)
    with PoolingClient(server.address, model=name, timeout=60) as client:
        got = np.array([o.outputs.embedding for o in client.embed(TEXTS)])
        card = next(m for m in client.models() if m.name == name)
        scores = client.score(TEXTS[0], TEXTS[1:])
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=0, atol=2e-6)
    assert card.hidden_size == expected.shape[1]
    first, rest = expected[0], expected[1:]
    cosine = rest @ first / (np.linalg.norm(rest, axis=1) * np.linalg.norm(first))
    assert [s.outputs.score for s in scores] == pytest.approx(cosine.tolist(), abs=1e-5)


def test_untrusted_activation_refuses_to_load(folders: dict[str, Path], tmp_path: Path) -> None:
    """An activation outside torch.nn would run code the folder names: refused at load."""
    from pooling_server.engine.models.dense import load_dense
    from pooling_server.engine.models.folder_reading import read_sentence_transformers

    config_path = folders["tanh"] / "2_Dense" / "config.json"
    config = json.loads(config_path.read_text())
    assert config["activation_function"].startswith("torch.")
    bad = tmp_path / "2_Dense"
    bad.mkdir()
    for file in (folders["tanh"] / "2_Dense").iterdir():
        (bad / file.name).write_bytes(file.read_bytes())
    (bad / "config.json").write_text(json.dumps({**config, "activation_function": "os.system"}))
    with pytest.raises(ValueError, match=r"not a torch\.nn module"):
        load_dense(bad)
    assert len(read_sentence_transformers(folders["stacked"]).dense) == 3
