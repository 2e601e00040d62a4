"""A front end of a split server: when to connect, and the engine it serves from.

The gRPC and HTTP doors (service/server.py) are the same as in a one-process server; only
the engine differs: tokenizers here, forward passes in the engine processes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pooling_server.engine.scheduling.engine import Engine
from pooling_server.engine.scheduling.remote_client import RemoteEngineClient
from pooling_server.service.ops.config import ServerConfig
from pooling_server.service.split.run_dir import (
    frontend_ready,
    is_ready,
    mark_frontend_ready,
    read_ready,
)

READY_POLL_S = 0.05


@dataclass
class FrontendRole:
    """This process is front end `index` of `frontends` in a split server (supervisor.py).

    It listens at once (NOT_SERVING), connects once every engine is warm, and reports
    SERVING only once every front end has connected.
    """

    index: int
    frontends: int
    run_dir: str
    engines: int
    alive_fds: Sequence[int] = ()
    on_engines_changed: Callable[[], None] | None = None

    async def engines_ready(self) -> None:
        while not all(is_ready(self.run_dir, k) for k in range(self.engines)):
            await asyncio.sleep(READY_POLL_S)

    async def all_ready(self) -> None:
        mark_frontend_ready(self.run_dir, self.index)
        while not all(frontend_ready(self.run_dir, i) for i in range(self.frontends)):
            await asyncio.sleep(READY_POLL_S)


def connect_engine(config: ServerConfig, frontend: FrontendRole) -> Engine:
    """A front end's engine: tokenizers from the engine processes' descriptions, and a
    client that sends them the jobs. Loads no weights, and neither torch nor transformers."""
    engines = [read_ready(frontend.run_dir, k) for k in range(frontend.engines)]
    served = [description.served(config.engines_per_device) for description in engines[0].models]
    client = RemoteEngineClient(
        engines,
        origin=frontend.index,
        alive_fds=frontend.alive_fds,
        on_engines_changed=frontend.on_engines_changed,
        stall_s=config.engine_stall_s,
    )
    return Engine(
        served,
        config.limits,
        tokenizer_threads=config.tokenizer_threads,
        client=client,
        cache=config.cache,
    )
