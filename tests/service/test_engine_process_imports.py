"""An engine process of a split server imports neither grpc nor aiohttp.

It holds the models and talks to front ends over IPC only, so the gRPC and HTTP doors are
memory (and start-up time) it would carry for nothing. Each check runs in a fresh
interpreter: this one imported both long ago. The live engine child of a real split server
is checked in tests/service/split/test_frontends.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# The modules an engine process must not hold, as the check in the child sees them.
FORBIDDEN = "m == 'grpc' or m.startswith(('grpc.', 'grpc_', 'aiohttp'))"


def _imports_in_fresh_interpreter(code: str) -> list[str]:
    """The forbidden modules loaded after `code` runs in a new interpreter."""
    check = (
        f"{code}\nimport json, sys\n"
        f"print(json.dumps(sorted(m for m in sys.modules if {FORBIDDEN})))"
    )
    done = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_engine_process_module_imports_no_grpc_nor_aiohttp() -> None:
    assert _imports_in_fresh_interpreter("import pooling_server.service.split.engine_process") == []


def test_engine_role_through_the_cli_imports_no_grpc_nor_aiohttp() -> None:
    """What `-m pooling_server.service.launch --role engine` imports before it serves: the launch
    module, the flags and config, the engine process's main and the model loading (torch,
    transformers)."""
    code = (
        "import pooling_server.service.launch\n"
        "import pooling_server.service.cli as cli\n"
        "args = cli.parse_args(['--role', 'engine', '--role-index', '0', '--run-dir', '/tmp',"
        " '--stop-fd', '0', '--frontends', '1'], environ={})\n"
        "cli.config_from_args(args)\n"
        "from transformers.utils import logging\n"
        "import pooling_server.service.split.engine_process, pooling_server.service.loading\n"
    )
    assert _imports_in_fresh_interpreter(code) == []


@pytest.mark.parametrize(
    "module",
    [
        "pooling_server.service.ops.config",
        "pooling_server.service.split.supervisor",
        "pooling_server.service.split.run_dir",
    ],
)
def test_light_modules_import_no_grpc_nor_aiohttp(module: str) -> None:
    """Config and the supervisor are read by every process of a split server."""
    assert _imports_in_fresh_interpreter(f"import {module}") == []


def test_the_check_sees_grpc_and_aiohttp() -> None:
    """The front end's module imports both: the check above is not vacuous."""
    found = _imports_in_fresh_interpreter("import pooling_server.service.server")
    assert "grpc" in found and "aiohttp" in found
