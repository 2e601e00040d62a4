"""An engine process of a split server: load the models on one device and serve front ends.

Started by the supervisor. It holds the write end of a pipe whose read ends the front ends
watch: when this process dies for any reason the kernel closes it, and every call waiting
here fails at once (engine/scheduling/remote_client.py).

It ignores SIGTERM and SIGINT: systemd, `timeout`, `tini -g` and Ctrl-C signal the whole
process group, and an engine that stopped then would fail every call the front ends are
still finishing (service/launch.py sets them to SIG_IGN). It stops only when the supervisor
closes the stop pipe (--stop-fd), which it does once every front end has drained, and which
the kernel also closes if the supervisor dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
from dataclasses import replace
from typing import TYPE_CHECKING

import msgspec

from pooling_server.engine.models.served import ModelDescription
from pooling_server.engine.scheduling.batch_queue import BatchConfig
from pooling_server.engine.scheduling.core import EngineCore
from pooling_server.engine.scheduling.ipc import EngineReady, LoadModel
from pooling_server.service.ops import logs
from pooling_server.service.ops.config import ServerConfig
from pooling_server.service.ops.metrics import EngineStats, Metrics
from pooling_server.service.split.run_dir import engine_address, write_ready

if TYPE_CHECKING:
    from pooling_server.engine.models.model_runner import LoadedModel

log = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.25  # how often queue depth and drop counts reach /metrics


def engine_config(config: ServerConfig, index: int) -> ServerConfig:
    """Engine `index` of `data_parallel` x `engines_per_device`: engines 0..K-1 share the
    first GPU, K..2K-1 the second, and so on; on CPU each takes its share of the cores."""
    devices, per_device = config.data_parallel, config.engines_per_device
    count = devices * per_device
    if count == 1:
        return config
    import torch

    if config.device in ("auto", "cuda") and torch.cuda.device_count() >= 1:
        if devices > 1 and torch.cuda.device_count() >= devices:
            return replace(config, device=f"cuda:{index // per_device}")
        if devices == 1:
            return replace(config, device="cuda:0")
    if config.torch_threads is None and config.device in ("auto", "cpu"):
        cores = len(os.sched_getaffinity(0))
        return replace(config, torch_threads=max(1, cores // count))
    return config


class RunTimeModels:
    """Models this engine loads at run time when a front end asks (service/repository.py's
    RemoteHost): parsed by the command line's parser, loaded on a worker thread."""

    def __init__(self, config: ServerConfig, batch: BatchConfig) -> None:
        self.config = config
        self.batch = batch

    async def load(self, message: LoadModel) -> tuple[LoadedModel, bytes, int]:
        from pooling_server.service.loading import load_aside, load_one, model_bytes
        from pooling_server.service.repository import load_spec

        own = [spec for spec in self.config.models if spec.served_name == message.name]
        if message.startup and own:
            spec, dtype = own[0], None
        else:
            spec, dtype = load_spec(message.name, message.source, message.options)
        loaded = await load_aside(load_one, self.config, spec, self.batch, False, dtype)
        description = msgspec.json.encode(ModelDescription(loaded.info, loaded.tokenizer.spec))
        return loaded, description, model_bytes(loaded)

    async def release(self) -> None:
        from pooling_server.service.loading import release_memory

        await asyncio.to_thread(release_memory)


async def run_engine(
    config: ServerConfig, index: int, run_dir: str, stop_fd: int | None = None
) -> int:
    """Serve until `stop_fd` (the read end of the supervisor's stop pipe) reads end-of-file."""
    from pooling_server.service.loading import load_models  # torch and transformers

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    if stop_fd is not None:

        def stop_requested() -> None:  # end-of-file stays readable: read it once
            loop.remove_reader(stop_fd)
            stop.set()

        loop.add_reader(stop_fd, stop_requested)
    config = engine_config(config, index)
    loading = asyncio.ensure_future(asyncio.to_thread(load_models, config))
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({loading, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if not loading.done():
        # No front end has sent anything yet (they wait for the ready file), so nothing
        # is lost; a load thread cannot be interrupted, and waiting for it could take
        # minutes.
        log.info("engine %d stopped while loading", index)
        logs.shutdown()
        os._exit(0)
    stopped.cancel()
    models, batch = loading.result()
    run_time = (
        RunTimeModels(config, batch) if config.admin_keys or config.model_repository else None
    )
    core = EngineCore(models, batch, engine_address(run_dir, index), run_time, config.cache)
    await core.start()
    device = models[0].info.device if models else config.device
    engines = config.data_parallel * config.engines_per_device
    stats = EngineStats(Metrics(multiprocess=True), core.queues, device, engines)
    descriptions = [ModelDescription(m.info, m.tokenizer.spec) for m in models]
    write_ready(run_dir, index, EngineReady(core.address, os.getpid(), descriptions))
    log.info(
        "engine %d ready on %s, one of %d engine(s) on that device (%s)",
        index,
        device,
        config.engines_per_device,
        core.address,
    )

    serving = asyncio.create_task(core.serve())
    while not stop.is_set():
        stats.sync()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), STATS_INTERVAL_S)
    serving.cancel()
    await core.stop()
    log.info("engine %d stopped", index)
    gc.freeze()  # the process exits next: skip collecting torch's object graph (seconds)
    return 0
