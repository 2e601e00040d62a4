"""service/ops/event_loop.py: which loop --event-loop gives, and a clear refusal without uvloop."""

from __future__ import annotations

import asyncio
import sys

import pytest
import uvloop

from pooling_server.service.ops import event_loop


async def _running_loop() -> tuple[str, type]:
    return event_loop.loop_name(), type(asyncio.get_running_loop())


def test_auto_and_uvloop_run_on_uvloop() -> None:
    for kind in ("auto", "uvloop"):
        name, loop_type = event_loop.run(_running_loop(), kind)
        assert name == "uvloop" and issubclass(loop_type, uvloop.Loop), kind


def test_asyncio_runs_on_asyncios_own_loop() -> None:
    name, loop_type = event_loop.run(_running_loop(), "asyncio")
    assert name == "asyncio" and not issubclass(loop_type, uvloop.Loop)


def test_without_uvloop_auto_falls_back_and_uvloop_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # `import uvloop` raises ImportError
    assert event_loop.run(_running_loop(), "auto")[0] == "asyncio"
    with pytest.raises(SystemExit, match="--event-loop uvloop needs the uvloop package"):
        event_loop.loop_factory("uvloop")
