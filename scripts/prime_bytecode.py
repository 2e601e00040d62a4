"""Write the .pyc files of what the server imports, once, at `make venv`.

pip compiles one file at a time, and compileall would compile all ~17,000 files of the
venv, most of them never imported. Importing what the server's processes import writes the
~4,000 they need, in two processes side by side. Some machines set
PYTHONDONTWRITEBYTECODE, under which nothing would ever be written and every process would
compile torch and transformers again: so this runs with it unset.
"""

from __future__ import annotations

import os
import subprocess
import sys

# Two groups of about the same cost; a module missing from the venv is skipped (the
# backends are optional).
GROUPS = (
    (
        "pooling_server.service.launch",
        "pooling_server.service.server",
        "pooling_server.service.split.engine_process",
        "pooling_server.service.loading",
        "transformers.models.bert.modeling_bert",
    ),
    (
        "openvino",
        "onnxruntime",
        "onnxruntime.quantization",
        "torch.onnx",
        "nncf",
        "sentence_transformers",
        "pytest",
        "hypothesis",
    ),
)

IMPORT = """
import importlib, sys
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except ImportError:
        pass
"""


def main() -> int:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    children = [
        subprocess.Popen([sys.executable, "-c", IMPORT, *group], env=env, stderr=subprocess.DEVNULL)
        for group in GROUPS
    ]
    return max(child.wait() for child in children)


if __name__ == "__main__":
    sys.exit(main())
