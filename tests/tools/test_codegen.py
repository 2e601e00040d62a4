"""The committed generated code and the schema can never drift apart, and the schema lints clean."""

from __future__ import annotations

import filecmp
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HOMES = (ROOT / "clients" / "python" / "pooling_client" / "v1", ROOT / "service" / "proto")
BUF = ROOT / "tools" / "node_modules" / ".bin" / "buf"


@pytest.mark.parametrize("home", HOMES, ids=lambda home: home.relative_to(ROOT).as_posix())
def test_generated_code_matches_the_schema(tmp_path: Path, home: Path) -> None:
    """The client's copy and the server's: each package carries its own, from one .proto."""
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--out", str(tmp_path)],
        check=True,
    )
    names = ["pooling_pb2.py", "pooling_pb2.pyi", "pooling_pb2_grpc.py"]
    match, mismatch, errors = filecmp.cmpfiles(tmp_path, home, names, shallow=False)
    assert not mismatch and not errors, f"regenerate with `make proto`: {mismatch + errors} differ"
    assert sorted(match) == sorted(names)


def test_both_copies_share_message_classes() -> None:
    """A message built with the client's module is the server's message class too."""
    from pooling_client.v1 import pooling_pb2 as client_pb
    from pooling_server.service.proto import pooling_pb2 as server_pb

    assert client_pb.PoolRequest is server_pb.PoolRequest
    assert client_pb.DESCRIPTOR is server_pb.DESCRIPTOR


def test_buf_lint_is_clean(tmp_path: Path) -> None:
    buf = str(BUF) if BUF.exists() else shutil.which("buf")
    if buf is None:
        pytest.skip("buf is not installed: run `make lint` (npm install in tools/) first")
    image = tmp_path / "pooling.binpb"
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--descriptor-set", str(image)],
        check=True,
    )
    result = subprocess.run(
        [buf, "lint", str(image), "--path", "pooling/v1/pooling.proto"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
