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
    # Compact encodings decode without numpy (struct); numpy output says how to get numpy.
    (reference,) = client.embed(["Hello world"])
    floats = reference.outputs.embedding
    for encoding, relative in (("float32", 0.0), ("float16", 2.0**-11), ("bfloat16", 2.0**-8)):
        (encoded,) = client.embed(["Hello world"], encoding=encoding)
        values = encoded.outputs.embedding
        assert len(values) == 384 and encoded.outputs.encoding == encoding
        # float16 rounds values under 2**-14 to a fixed step of 2**-24 (subnormals).
        slack = 2.0**-25 if encoding == "float16" else 0.0
        assert all(abs(v - f) <= abs(f) * relative + slack for v, f in zip(values, floats))
    (packed,) = client.embed(["Hello world"], encoding="ubinary")
    bits = [(packed.outputs.embedding[i // 8] >> (7 - i % 8)) & 1 for i in range(384)]
    assert bits == [int(f > 0) for f in floats]
    try:
        import numpy
    except ImportError:
        try:
            client.embed(["x"], output="numpy")
        except ImportError as error:
            assert "pooling-client[numpy]" in str(error), error
        else:
            sys.exit("expected ImportError for numpy output without numpy")
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
