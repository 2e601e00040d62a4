"""One real server for the TEI and Cohere door tests (tests/service/http/test_tei.py and
http/test_cohere.py share it through tests/service/conftest.py): an embedding model with
prompts and calibration ranges (the default), a classifier, a cross-encoder, two token
classifiers (WordPiece and byte-level BPE) and a SPLADE model (a masked LM with
--pooling-type splade); JSON answers are capped at 4 MB."""

from __future__ import annotations

import json
import shutil
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

from pooling_client import PoolingClient
from tests.fixture_models import MAX_POSITIONS, MINILM, tiny_bpe_ner
from tests.server_process import free_port, start_server
from tests.service.http_calls import HttpServer

KEY = "doors-test-key"
PROMPTS = {"query": "query: ", "document": "passage: "}
MAX_CLIENT_BATCH_SIZE = 16
WIDTH = 32  # the tiny models' hidden size


@dataclass
class DoorsServer(HttpServer):
    folders: dict[str, Path] = field(default_factory=dict)  # each served model's folder

    def grpc(self) -> PoolingClient:
        return PoolingClient(self.process.address, timeout=60, api_key=KEY)


def prompted_folder(model_folders: dict[str, Path], root: Path) -> Path:
    """tiny-st-mean with sentence-transformers prompts and int8 calibration ranges."""
    folder = Path(shutil.copytree(model_folders["tiny-st-mean"], root / "st-prompts"))
    (folder / "config_sentence_transformers.json").write_text(json.dumps({"prompts": PROMPTS}))
    spread = np.linspace(0.2, 0.4, WIDTH)
    np.save(folder / "calibration_ranges.npy", np.vstack([-spread, spread]))
    return folder


def splade_folder(root: Path) -> Path:
    """A tiny random masked LM (the MiniLM vocabulary), served with --pooling-type splade."""
    torch.manual_seed(0)
    config = BertConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=MAX_POSITIONS,
    )
    folder = root / "splade"
    BertForMaskedLM(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(MINILM).save_pretrained(folder)
    return folder


def start_doors(model_folders: dict[str, Path], root: Path) -> Iterator[DoorsServer]:
    http_port, metrics_port = free_port(), free_port()
    folders = {
        "embedder": prompted_folder(model_folders, root),
        "classifier": model_folders["tiny-classifier"],
        "cross": model_folders["tiny-cross-encoder"],
        "ner": model_folders["tiny-ner"],
        "ner-bpe": tiny_bpe_ner(root / "ner-bpe"),
        "splade": splade_folder(root),
    }
    args = [
        *(f"--model={name}={folder}" for name, folder in folders.items()),
        *("--pooling-type", "auto") * 5,
        "--pooling-type",
        "splade",
        "--max-http-response-mb",
        "4",
        "--dtype",
        "float32",
        "--max-client-batch-size",
        str(MAX_CLIENT_BATCH_SIZE),
        "--http-port",
        str(http_port),
        "--api-key",
        KEY,
        "--cohere-input-type-prompt",
        "clustering=document",
        "--metrics-port",
        str(metrics_port),
    ]
    process = start_server(args, root, "doors")
    try:
        yield DoorsServer(process, http_port, metrics_port, KEY, folders)
    finally:
        process.stop(signal.SIGTERM)


@pytest.fixture(scope="session")
def doors(
    model_folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DoorsServer]:
    yield from start_doors(model_folders, tmp_path_factory.mktemp("doors"))
