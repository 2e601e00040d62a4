"""The folder a split server's processes share: IPC endpoints, engines' ready files, metrics.

The supervisor makes it and removes it; an engine writes its ready file (atomically) once
its models are warm; front ends read every one, then mark themselves ready, and serve once
all have.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from pooling_server.engine.scheduling.ipc import EngineReady


def engine_address(run_dir: str, index: int) -> str:
    """The Unix socket engine `index` listens on for front ends."""
    return f"{run_dir}/engine-{index}.sock"


def metrics_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "metrics")


def _ready_path(run_dir: str, index: int) -> Path:
    return Path(run_dir) / f"engine-{index}.ready.json"


def write_ready(run_dir: str, index: int, ready: EngineReady) -> None:
    path = _ready_path(run_dir, index)
    partial = path.with_suffix(".partial")
    partial.write_bytes(msgspec.json.encode(ready))
    partial.rename(path)


def is_ready(run_dir: str, index: int) -> bool:
    return _ready_path(run_dir, index).is_file()


def read_ready(run_dir: str, index: int) -> EngineReady:
    return msgspec.json.decode(_ready_path(run_dir, index).read_bytes(), type=EngineReady)


def _frontend_ready_path(run_dir: str, index: int) -> Path:
    return Path(run_dir) / f"frontend-{index}.ready"


def mark_frontend_ready(run_dir: str, index: int) -> None:
    _frontend_ready_path(run_dir, index).touch()


def frontend_ready(run_dir: str, index: int) -> bool:
    return _frontend_ready_path(run_dir, index).is_file()
