"""Another front end's run-time loads and unloads, as the engines tell of them (split
server). Models and LoRA adapters follow one rule: a load is routed here once every live
engine has told of it; an unload is withdrawn here once, however many engines tell of it,
and each engine is answered once the name is out of routing here and its calls here are
answered, so no engine frees weights a call here may still use."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from pooling_server.engine.scheduling.ipc import ModelChanged


class Notices:
    """The engines that told of each name's load, and the withdrawals under way here."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.told: dict[str, set[int]] = {}
        self._withdrawals: dict[str, asyncio.Task[None]] = {}

    def all_told(self, engine: int, name: str) -> bool:
        """`engine` has loaded `name`: whether every live engine has now."""
        told = self.told.setdefault(name, set())
        told.add(engine)
        client = self.engine.client
        return set(range(len(client.engines))) - client.dead <= told

    def unloading(
        self,
        engine: int,
        change: ModelChanged,
        withdraw: Callable[[str], Coroutine[Any, Any, None]],
    ) -> None:
        """`engine` is unloading `change.name`: withdraw it here (once), then answer it."""
        name, client = change.name, self.engine.client
        self.told.pop(name, None)
        withdrawal = self._withdrawals.get(name)
        if withdrawal is None:
            withdrawal = self._withdrawals[name] = asyncio.create_task(withdraw(name))
            withdrawal.add_done_callback(lambda _: self._withdrawals.pop(name, None))
        withdrawal.add_done_callback(lambda _: client.withdrawn(engine, change.id))
