"""The committed generated code and the schema can never drift apart, and the schema lints clean."""

from __future__ import annotations

import filecmp
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ROOT / "clients" / "python" / "pooling_client" / "v1"
BUF = ROOT / "tools" / "node_modules" / ".bin" / "buf"


def test_generated_code_matches_the_schema(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--out", str(tmp_path)],
        check=True,
    )
    names = ["pooling_pb2.py", "pooling_pb2.pyi", "pooling_pb2_grpc.py"]
    match, mismatch, errors = filecmp.cmpfiles(tmp_path, GENERATED, names, shallow=False)
    assert not mismatch and not errors, f"regenerate with `make proto`: {mismatch + errors} differ"
    assert sorted(match) == sorted(names)


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
