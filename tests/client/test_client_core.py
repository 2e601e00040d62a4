"""The sync and async clients are one implementation: client.py is generated from
async_client.py, and only the two small I/O modules differ."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

from pooling_client import AsyncPoolingClient, PoolingClient

ROOT = Path(__file__).resolve().parents[2]


def test_sync_client_is_generated_from_the_async_one() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "unasync_client.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr


def test_both_clients_have_the_same_methods_and_signatures() -> None:
    def public(cls: type) -> dict[str, inspect.Signature]:
        return {
            name: inspect.signature(member)
            for name, member in vars(cls).items()
            if callable(member) and not name.startswith("_")
        }

    sync, asynchronous = public(PoolingClient), public(AsyncPoolingClient)
    assert sync.keys() == asynchronous.keys()
    for name, signature in sync.items():
        assert str(signature) == str(asynchronous[name]).replace(
            "AsyncPoolingClient", "PoolingClient"
        )
        assert inspect.iscoroutinefunction(getattr(AsyncPoolingClient, name))
        assert not inspect.iscoroutinefunction(getattr(PoolingClient, name))
