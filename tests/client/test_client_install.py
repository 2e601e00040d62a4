"""The client installs into a fresh virtual environment without torch and talks to the server."""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

from tests.server_process import ServerProcess

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys
try:
    import torch
except ImportError:
    pass
else:
    sys.exit("torch must not be importable in the client environment")
try:
    import transformers
except ImportError:
    pass
else:
    sys.exit("transformers must not be importable in the client environment")
from pooling_client import PoolingClient, PoolingError, PoolingParams

with PoolingClient(sys.argv[1]) as client:
    params = PoolingParams(use_activation=True)
    outputs = client.embed(["Hello world", "How are you?"], pooling_params=params)
    assert len(outputs) == 2 and len(outputs[0].outputs.embedding) == 384
    try:
        client.embed(["x"], model="no-such-model")
    except PoolingError as error:
        assert error.reason == "MODEL_NOT_FOUND", error
    else:
        sys.exit("expected MODEL_NOT_FOUND")
print("client ok")
"""


def test_client_installs_without_torch(tmp_path: Path, server: ServerProcess) -> None:
    env_dir = tmp_path / "client-venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", str(ROOT / "clients" / "python")],
        check=True,
        timeout=600,
    )
    installed = subprocess.run(
        [str(python), "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True
    ).stdout.lower()
    assert "torch" not in installed and "transformers" not in installed
    result = subprocess.run(
        [str(python), "-c", SCRIPT, server.address], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "client ok" in result.stdout
    assert sys.prefix != str(env_dir)
