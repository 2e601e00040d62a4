"""The Node.js client (clients/node) passes its own test suite against the real server.

Runs ``node --test`` in clients/node with POOLING_SERVER_ADDRESS pointing at the session server
and checks node's TAP summary: every test passed and none was skipped. Also checks that the
Node client's embedding of a text equals the Python client's. Skipped where node or npm is not
installed; node_modules is installed from the lockfile (``npm ci``) when missing.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from pooling_client import PoolingClient
from tests.server_process import ServerProcess

ROOT = Path(__file__).resolve().parents[2]
NODE_DIR = ROOT / "clients" / "node"
MIN_NODE_MAJOR = 20
TIMEOUT = 300

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


def _run_node_tests(
    node: str, address: str | None
) -> tuple[subprocess.CompletedProcess[str], dict[str, int]]:
    """Run the whole Node suite with the TAP reporter; return the run and its summary counts."""
    result = subprocess.run(
        [node, "--test", "--test-reporter=tap"],
        cwd=NODE_DIR,
        env=_node_env(address),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
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
    result = subprocess.run(
        [node, "scripts/embed.js", "--address", server.address, *texts],
        cwd=NODE_DIR,
        env=_node_env(None),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    node_embeddings = json.loads(result.stdout)["embeddings"]
    python_embeddings = [output.outputs.embedding for output in client.embed(texts)]
    assert len(node_embeddings) == len(python_embeddings) == len(texts)
    for from_node, from_python in zip(node_embeddings, python_embeddings, strict=True):
        assert len(from_node) == len(from_python) == 384
        diff = max(abs(a - b) for a, b in zip(from_node, from_python, strict=True))
        assert diff < 1e-6, f"Node and Python embeddings differ by {diff}"
