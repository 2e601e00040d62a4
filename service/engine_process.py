"""An engine process of a split server: load the models on one device and serve front ends.

Started by the supervisor. It holds the write end of a pipe whose read ends the front ends
watch: when this process dies for any reason the kernel closes it, and every call waiting
here fails at once (engine/remote.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from dataclasses import replace

from engine.core import EngineCore
from engine.ipc import EngineReady
from engine.served import ModelDescription
from service.metrics import EngineStats, Metrics
from service.run_dir import engine_address, write_ready
from service.server import ServerConfig

log = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.25  # how often queue depth and drop counts reach /metrics


def engine_config(config: ServerConfig, index: int) -> ServerConfig:
    """Engine `index` of `data_parallel`: its own GPU, or its share of the CPU cores."""
    count = config.data_parallel
    if count == 1:
        return config
    import torch

    if config.device in ("auto", "cuda") and torch.cuda.device_count() >= count:
        return replace(config, device=f"cuda:{index}")
    if config.torch_threads is None and config.device in ("auto", "cpu"):
        cores = len(os.sched_getaffinity(0))
        return replace(config, torch_threads=max(1, cores // count))
    return config


async def run_engine(config: ServerConfig, index: int, run_dir: str) -> int:
    from service.loading import load_models  # torch and transformers

    config = engine_config(config, index)
    models, batch = await asyncio.to_thread(load_models, config)
    core = EngineCore(models, batch, engine_address(run_dir, index))
    await core.start()
    stats = EngineStats(Metrics(multiprocess=True), core.queues)
    descriptions = [ModelDescription(m.info, m.tokenizer.spec) for m in models]
    write_ready(run_dir, index, EngineReady(core.address, os.getpid(), descriptions))
    log.info("engine %d ready on %s (%s)", index, config.device, core.address)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    # Ctrl-C reaches every process of the group: the supervisor stops this engine only
    # once the front ends have drained, so it ignores SIGINT.
    loop.add_signal_handler(signal.SIGINT, lambda: None)
    serving = asyncio.create_task(core.serve())
    while not stop.is_set():
        stats.sync()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), STATS_INTERVAL_S)
    serving.cancel()
    await core.stop()
    log.info("engine %d stopped", index)
    return 0
