"""Which asyncio event loop a server process runs on, and running a coroutine on it.

The front end's event loop is where a call's per-request CPU goes once the forward pass is
cheap: grpc.aio's callbacks, the wake-ups from the tokenizer and forward threads, the
select. uvloop (libuv) runs the same asyncio code with less of the loop's own Python per
turn, as vLLM's and most aiohttp servers do; the plain loop stays one flag away.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

CHOICES = ("auto", "uvloop", "asyncio")


def loop_factory(kind: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The factory for `kind` (None: asyncio's own loop). auto: uvloop if it imports."""
    if kind == "asyncio":
        return None
    try:
        import uvloop
    except ImportError as error:
        if kind == "uvloop":
            raise SystemExit(
                f"--event-loop uvloop needs the uvloop package, which does not import here "
                f"({error}); install it or pass --event-loop asyncio"
            ) from error
        return None
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T], kind: str = "auto") -> T:
    """asyncio.run on the loop `kind` names."""
    with asyncio.Runner(loop_factory=loop_factory(kind)) as runner:
        return runner.run(main)


def loop_name() -> str:
    """The running loop's kind, for the start-up log."""
    module = type(asyncio.get_running_loop()).__module__
    return "uvloop" if module.startswith("uvloop") else "asyncio"
