"""The Node.js client (clients/node) passes its own test suite against the real server.

Runs ``node --test`` in clients/node with POOLING_SERVER_ADDRESS pointing at the session server
and checks node's TAP summary: every test passed and none was skipped. Also checks that the
Node client's embedding of a text equals the Python client's, and, on a server of a tiny
ColBERT and a tiny Qwen3 reranker, that its embed_multi matrices, ModelCard fields and
instructed rerank equal the Python client's (or the raw stub's). Skipped where node or npm is
not installed; node_modules is installed from the lockfile (``npm ci``) when missing.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from pooling_client import PoolingClient
from pooling_client.v1 import pooling_pb2 as pb
from pooling_client.v1 import pooling_pb2_grpc
from tests.fixture_models import COLBERT_DIM, tiny_colbert, tiny_qwen3_reranker
from tests.server_process import ServerProcess, running_server

ROOT = Path(__file__).resolve().parents[2]
NODE_DIR = ROOT / "clients" / "node"
MIN_NODE_MAJOR = 20
TIMEOUT = 480
TEST_TIMEOUT_MS = 120_000  # one node test; the whole run has TIMEOUT

_SUMMARY = re.compile(r"^# (tests|suites|pass|fail|cancelled|skipped|todo) (\d+)\s*$", re.MULTILINE)


def _require_node() -> tuple[str, str]:
    """Paths of node and npm, skipping the test when either is missing or node is too old."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        missing = " and ".join(name for name, path in (("node", node), ("npm", npm)) if not path)
        pytest.skip(f"{missing} not installed: the Node.js client tests need Node.js >= 20 and npm")
    version = subprocess.run(
        [node, "--version"], capture_output=True, text=True, check=True, timeout=30
    ).stdout.strip()
    major = int(version.lstrip("v").split(".")[0])
    if major < MIN_NODE_MAJOR:
        pytest.skip(f"node {version} is too old: the Node.js client needs >= {MIN_NODE_MAJOR}")
    return node, npm


def install_node_modules(npm: str) -> None:
    """clients/node's dependencies from the lockfile, once: the two Node test files may run
    on two workers at once, and one must not read node_modules while the other's `npm ci`
    is still writing it (a lock file beside it orders them)."""
    with (NODE_DIR / ".node-modules.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (NODE_DIR / "node_modules").is_dir():
            return
        result = subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund"],
            cwd=NODE_DIR,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
        assert result.returncode == 0, f"npm ci failed:\n{result.stdout}\n{result.stderr}"


@pytest.fixture(scope="module")
def node() -> str:
    """The node executable, with clients/node's dependencies installed from the lockfile."""
    node, npm = _require_node()
    install_node_modules(npm)
    return node


def _node_env(address: str | None) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key != "POOLING_SERVER_ADDRESS"}
    if address is not None:
        env["POOLING_SERVER_ADDRESS"] = address
    return env


@contextmanager
def node_tree() -> Iterator[None]:
    """Hold clients/node to oneself: `npm pack` (tests/client/test_node_pack.py) writes and
    then removes the bundled proto/ there, which the client's tests, in another worker,
    would otherwise find and then lose mid-run (ENOENT in a hook)."""
    with (NODE_DIR / ".node-tree.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def run_node(command: list[str], address: str | None = None) -> subprocess.CompletedProcess[str]:
    """`command` (node and its arguments) in clients/node, held to itself (node_tree)."""
    with node_tree():
        return subprocess.run(
            command,
            cwd=NODE_DIR,
            env=_node_env(address),
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )


def _run_node_tests(
    node: str, address: str | None
) -> tuple[subprocess.CompletedProcess[str], dict[str, int]]:
    """Run the whole Node suite with the TAP reporter; return the run and its summary counts.
    A test that hangs fails by its name (node's own timeout) before the run's."""
    result = run_node(
        [node, "--test", f"--test-timeout={TEST_TIMEOUT_MS}", "--test-reporter=tap"], address
    )
    summary = {name: int(count) for name, count in _SUMMARY.findall(result.stdout)}
    return result, summary


def test_node_suite_passes_against_server(node: str, server: ServerProcess) -> None:
    result, summary = _run_node_tests(node, server.address)
    output = f"{result.stdout}\n{result.stderr}"
    assert result.returncode == 0, output
    assert {"tests", "pass", "fail", "skipped"} <= summary.keys(), output
    assert summary["pass"] > 0, output
    assert summary["pass"] == summary["tests"], output
    assert summary["fail"] == 0, output
    assert summary["skipped"] == 0, output
    assert summary.get("cancelled", 0) == 0, output
    assert summary.get("todo", 0) == 0, output


def test_node_live_tests_skip_without_server_address(node: str) -> None:
    result, summary = _run_node_tests(node, None)
    output = f"{result.stdout}\n{result.stderr}"
    assert result.returncode == 0, output
    assert summary["fail"] == 0, output
    assert summary["skipped"] > 0, output
    assert "POOLING_SERVER_ADDRESS is not set" in result.stdout, output


def test_node_embedding_matches_python_client(
    node: str, server: ServerProcess, client: PoolingClient
) -> None:
    texts = ["Hello world", "The Node client must agree with the Python client."]
    result = run_node([node, "scripts/embed.js", "--address", server.address, *texts])
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    node_embeddings = json.loads(result.stdout)["embeddings"]
    python_embeddings = [output.outputs.embedding for output in client.embed(texts)]
    assert len(node_embeddings) == len(python_embeddings) == len(texts)
    for from_node, from_python in zip(node_embeddings, python_embeddings, strict=True):
        assert len(from_node) == len(from_python) == 384
        diff = max(abs(a - b) for a, b in zip(from_node, from_python, strict=True))
        assert diff < 1e-6, f"Node and Python embeddings differ by {diff}"


QUERY = "what is the capital of france?"
DOCUMENTS = ["Paris is the capital of France.", "b!", "The sky is blue, mostly. " * 4]
INSTRUCTION = "Find the passage that names a capital city"


@pytest.fixture(scope="module")
def retrieval_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server of a tiny ColBERT (PyLate layout) and a tiny Qwen3 reranker: the models the
    Node client's embed_multi and rerank instruction need."""
    root = tmp_path_factory.mktemp("node-retrieval")
    colbert = tiny_colbert(root / "colbert")
    reranker = tiny_qwen3_reranker(root / "qwen3-reranker")
    args = ["--model", f"colbert={colbert}", "--model", f"rr={reranker}", "--dtype", "float32"]
    yield from running_server(
        args, tmp_path_factory.mktemp("node-retrieval-logs"), "node-retrieval"
    )


@pytest.fixture(scope="module")
def from_node(node: str, retrieval_server: ServerProcess) -> dict[str, Any]:
    """What scripts/contract.js prints: models, embed_multi matrices and reranks."""
    command = [node, "scripts/contract.js", "--address", retrieval_server.address]
    command += ["--colbert", "colbert", "--reranker", "rr", "--instruction", INSTRUCTION]
    command += ["--query", QUERY, *DOCUMENTS]
    result = run_node(command)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    return json.loads(result.stdout)


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


def test_node_models_carry_the_newer_model_card_fields(
    from_node: dict[str, Any], retrieval_server: ServerProcess
) -> None:
    with PoolingClient(retrieval_server.address, timeout=60) as python:
        want = {info.name: info for info in python.models()}
    got = {info["name"]: info for info in from_node["models"]}
    assert got.keys() == want.keys() == {"colbert", "rr"}
    for name, info in want.items():
        for field in (
            "engines_per_device",
            "calibration_source",
            "prompts",
            "default_prompt_name",
            "dtype",
            "device",
            "backend",
            "precision",
            "backend_file",
            "revision",
            "score_template_source",
            "modalities",
            "image_size",
            "outputs",
        ):
            assert got[name][_camel(field)] == getattr(info, field), (name, field)
    colbert = got["colbert"]
    assert colbert["tasks"] == ["embed_multi", "score"]
    assert colbert["enginesPerDevice"] >= 1
    assert colbert["multiVector"] == {_camel(k): v for k, v in want["colbert"].multi_vector.items()}
    assert colbert["multiVector"]["queryPrefix"] == "[Q] "
    assert colbert["multiVector"]["skiplistWords"] == list("!,.?;:")
    assert got["rr"]["multiVector"] is None
    # And the raw card, for the template's source.
    with grpc.insecure_channel(retrieval_server.address) as channel:
        cards = pooling_pb2_grpc.PoolingServiceStub(channel).ListModels(pb.ListModelsRequest())
    for card in cards.models:
        assert got[card.name]["scoreTemplateSource"] == card.score_template_source
    assert got["rr"]["scoreTemplateSource"] == "score_template.json"
    assert got["colbert"]["scoreTemplateSource"] == ""


@pytest.mark.parametrize("mode", ["query", "document"])
@pytest.mark.parametrize("encoding", ["float32", "float16"])
def test_node_embed_multi_equals_python_client(
    from_node: dict[str, Any], retrieval_server: ServerProcess, mode: str, encoding: str
) -> None:
    texts = [QUERY] if mode == "query" else DOCUMENTS
    with PoolingClient(retrieval_server.address, timeout=60) as python:
        want = python.encode(
            texts,
            model="colbert",
            pooling_task="embed_multi",
            prompt_name=mode,
            encoding=None if encoding == "float32" else encoding,
            output="numpy",
        )
    got = from_node["embedMulti"][mode][encoding]
    assert len(got) == len(want) == len(texts)
    for matrix, expected in zip(got, want, strict=True):
        assert (matrix["rows"], matrix["cols"]) == expected.shape
        assert matrix["cols"] == COLBERT_DIM and matrix["encoding"] == encoding
        values = np.asarray(matrix["data"], dtype=np.float32).reshape(expected.shape)
        # The same bytes decoded on both sides: float32 and float16 widen exactly.
        np.testing.assert_array_equal(values, np.asarray(expected, dtype=np.float32))
    if mode == "query":
        assert got[0]["rows"] == 12  # expanded to the folder's query_length


def test_node_rerank_sends_the_instruction(
    from_node: dict[str, Any], retrieval_server: ServerProcess
) -> None:
    with grpc.insecure_channel(retrieval_server.address) as channel:
        stub = pooling_pb2_grpc.PoolingServiceStub(channel)
        plain = stub.Rerank(pb.RerankRequest(model="rr", query=QUERY, documents=DOCUMENTS))
        instructed = stub.Rerank(
            pb.RerankRequest(model="rr", query=QUERY, documents=DOCUMENTS, instruction=INSTRUCTION)
        )
    for key, want in (("default", plain), ("instructed", instructed)):
        got = from_node["rerank"][key]
        assert got["model"] == "rr"
        assert [r["index"] for r in got["results"]] == [r.index for r in want.results], key
        assert [r["document"] for r in got["results"]] == [DOCUMENTS[r.index] for r in want.results]
        np.testing.assert_allclose(
            [r["relevanceScore"] for r in got["results"]],
            [r.relevance_score for r in want.results],
            rtol=1e-6,
        )
    # The instruction reached the template: the scores move.
    default = {r["index"]: r["relevanceScore"] for r in from_node["rerank"]["default"]["results"]}
    told = {r["index"]: r["relevanceScore"] for r in from_node["rerank"]["instructed"]["results"]}
    assert default != told
