"""The engine knows nothing of the transport: importing all of it loads no grpc or protobuf."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import pooling_server.engine as engine

ROOT = Path(__file__).resolve().parents[2]


def test_engine_imports_neither_grpc_nor_protobuf() -> None:
    modules = [m.name for m in pkgutil.walk_packages(engine.__path__, "pooling_server.engine.")]
    assert "pooling_server.engine.scheduling.batch_queue" in modules
    script = (
        "import importlib, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        "prefixes = ('grpc.', 'google.protobuf')\n"
        "loaded = [m for m in sys.modules if m == 'grpc' or m.startswith(prefixes)]\n"
        "print(loaded)\n"
        "sys.exit(1 if loaded else 0)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
