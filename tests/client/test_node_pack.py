"""`npm pack` of clients/node gives a package that works outside the repository.

The tarball must carry its own .proto files (pooling.proto and the google ones it imports),
since an installed package cannot reach ../../../protos. The package is unpacked into an
empty folder whose node_modules hold its runtime dependencies (taken from clients/node, as
the registry is out of reach in tests) but not the google-proto-files dev dependency; a
script there embeds through the session server, and must agree with the Python client.
"""

from __future__ import annotations

import json
import subprocess
import tarfile
from pathlib import Path

import pytest

from pooling_client import PoolingClient
from tests.client.test_node_client import (
    NODE_DIR,
    TIMEOUT,
    _require_node,
    install_node_modules,
    node_tree,
)
from tests.server_process import ServerProcess

SCRIPT = """
import { PoolingClient, DEFAULT_PROTO_PATH, googleProtosDir } from 'pooling-client';

const client = new PoolingClient(process.argv[2], { timeout: 60 });
try {
  const outputs = await client.embed(process.argv.slice(3));
  const embeddings = outputs.map((output) => output.outputs.embedding);
  const paths = { proto: DEFAULT_PROTO_PATH, google: googleProtosDir() };
  process.stdout.write(JSON.stringify({ embeddings, paths }));
} finally {
  client.close();
}
"""


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    _, npm = _require_node()
    install_node_modules(npm)
    out = tmp_path_factory.mktemp("npm-pack")
    with node_tree():  # the bundled proto/ lives in clients/node while npm packs
        result = subprocess.run(
            [npm, "pack", "--pack-destination", str(out)],
            cwd=NODE_DIR,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
        assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
        assert not (NODE_DIR / "proto").exists(), "postpack must remove the bundled copy"
    [tarball] = out.glob("pooling-client-*.tgz")
    return tarball


def test_tarball_carries_its_protos(packed: Path) -> None:
    with tarfile.open(packed) as tar:
        names = set(tar.getnames())
    for proto in (
        "pooling/v1/pooling.proto",
        "google/rpc/status.proto",
        "google/rpc/error_details.proto",
        "google/protobuf/any.proto",
        "google/protobuf/duration.proto",
    ):
        assert f"package/proto/{proto}" in names, sorted(names)
    manifest = json.loads((NODE_DIR / "package.json").read_text())
    assert "private" not in manifest
    assert "google-proto-files" not in manifest["dependencies"]
    bundled = (Path(__file__).resolve().parents[2] / "protos/pooling/v1/pooling.proto").read_text()
    with tarfile.open(packed) as tar:
        member = tar.extractfile("package/proto/pooling/v1/pooling.proto")
        assert member is not None and member.read().decode() == bundled


def test_installed_package_embeds_like_the_python_client(
    packed: Path, tmp_path: Path, server: ServerProcess, client: PoolingClient
) -> None:
    node, _ = _require_node()
    app = tmp_path / "app"
    modules = app / "node_modules"
    modules.mkdir(parents=True)
    (app / "package.json").write_text('{"name": "app", "private": true, "type": "module"}')
    with tarfile.open(packed) as tar:
        tar.extractall(app, filter="data")
    (app / "package").rename(modules / "pooling-client")
    for dependency in (NODE_DIR / "node_modules").iterdir():
        if dependency.name not in ("google-proto-files", ".package-lock.json"):
            (modules / dependency.name).symlink_to(dependency)
    (app / "embed.mjs").write_text(SCRIPT)
    texts = ["installed from a tarball", "in an empty folder"]
    result = subprocess.run(
        [node, "embed.mjs", server.address, *texts],
        cwd=app,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    answer = json.loads(result.stdout)
    package = modules / "pooling-client"
    assert Path(answer["paths"]["proto"]).is_relative_to(package)
    assert Path(answer["paths"]["google"]).is_relative_to(package)
    expected = [output.outputs.embedding for output in client.embed(texts)]
    for got, want in zip(answer["embeddings"], expected, strict=True):
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-6
