"""Loading the models onto a device: batch sizes, forward workers and threads for it.

Only a process that runs models imports this (and with it torch and transformers).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import torch

from pooling_server.engine.backends import RuntimeSettings
from pooling_server.engine.models.cuda_graphs import GraphSettings
from pooling_server.engine.models.loader import (
    LoadedModel,
    load_model,
    resolve_device,
    resolve_dtype,
)
from pooling_server.engine.models.model_runner import ThreadShare
from pooling_server.engine.models.model_spec import ModelSpec
from pooling_server.engine.scheduling.batch_queue import BatchConfig
from pooling_server.engine.scheduling.engine import Engine
from pooling_server.service.ops.config import ServerConfig
from pooling_server.service.ops.memory import trimmer

log = logging.getLogger(__name__)
T = TypeVar("T")


def _cores(config: ServerConfig) -> int:
    """The cores forward passes may use: --torch-threads, else every CPU this process may use
    (in a container, pass --torch-threads: the CPU limit does not show in the affinity)."""
    return config.torch_threads or len(os.sched_getaffinity(0))


def batch_config_for(config: ServerConfig, device: torch.device) -> BatchConfig:
    """Fill in what depends on the device: batch size cap and forward workers."""
    batch = config.batch
    if not batch.max_batch_size:
        batch = replace(batch, max_batch_size=256 if device.type == "cuda" else 32)
    if not batch.workers:
        batch = replace(batch, workers=2 if device.type == "cuda" else min(2, _cores(config)))
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    return batch


# Below this hidden size a pass's operations are too small to split across cores: the
# intra-op threads would spend more spinning between them than they save.
MIN_HIDDEN_FOR_THREADS = 128


def thread_share(
    config: ServerConfig, device: torch.device, workers: int, hidden_size: int
) -> ThreadShare | None:
    """On CPU a lone forward pass takes every core, and concurrent ones split them."""
    if device.type != "cpu":
        return None
    if hidden_size < MIN_HIDDEN_FOR_THREADS and not config.torch_threads:
        return ThreadShare(alone=1, shared=1)
    cores = _cores(config)
    return ThreadShare(alone=cores, shared=max(1, cores // workers))


def graph_settings(config: ServerConfig, batch: BatchConfig) -> GraphSettings | None:
    """--cuda-graphs: the shapes to capture follow the batcher's caps; None: off. Only a
    CUDA device with the torch backend captures (engine/models/loader.py)."""
    if not config.cuda_graphs:
        return None
    return GraphSettings(
        max_batch_size=batch.max_batch_size, max_batch_tokens=batch.max_batch_tokens
    )


def single_threaded_blas() -> None:
    """numpy's OpenBLAS keeps one thread: the forward passes run in torch's, ONNX Runtime's
    and OpenVINO's pools, sized by --torch-threads and --intra-op-threads, and a second pool
    beside them only oversubscribes the cores. Its multithreaded dot also hung for good in
    exec_blas in an engine process that had loaded OpenVINO models."""
    from threadpoolctl import threadpool_limits

    threadpool_limits(1, user_api="blas")


def load_models(config: ServerConfig) -> tuple[list[LoadedModel], BatchConfig]:
    """Every --model on the configured device, with the batch settings for that device."""
    single_threaded_blas()
    device = resolve_device(config.device)
    batch = batch_config_for(config, device)
    models = [
        load_one(config, spec, batch, is_default=index == 0)
        for index, spec in enumerate(config.models)
    ]
    return models, batch


def load_one(
    config: ServerConfig,
    spec: ModelSpec,
    batch: BatchConfig,
    is_default: bool = False,
    dtype: str | None = None,
) -> LoadedModel:
    """One model on the configured device: at start, or at run time (service/repository.py,
    where `dtype` is the Load call's own, else --dtype's)."""
    device = resolve_device(config.device)
    torch_dtype = resolve_dtype(dtype or config.dtype, device)
    cache = Path(config.backend_cache_dir).expanduser() if config.backend_cache_dir else None
    model = load_model(
        spec,
        device=device,
        dtype=torch_dtype,
        attn_implementation=config.attn_implementation,
        is_default=is_default,
        runtime=RuntimeSettings(cache_dir=cache),
        threads=config.intra_op_threads or _cores(config),
        cuda_graphs=graph_settings(config, batch),
    )
    info = model.info
    log.info(
        "loaded model %s (%s) on %s/%s: tasks %s, max %d tokens, pooling %s, backend %s %s%s",
        info.name,
        info.architecture,
        device,
        str(torch_dtype).removeprefix("torch."),
        ", ".join(info.tasks),
        info.max_input_tokens,
        info.pooling_type,
        info.backend,
        info.precision,
        f" ({info.backend_file})" if info.backend_file else "",
    )
    threads = thread_share(config, device, batch.workers, info.hidden_size)
    model.runner.threads = threads
    log.info(
        "model %s: %d forward worker(s), intra-op threads %s, batches of at most %d",
        info.name,
        batch.workers,
        threads or torch.get_num_threads(),
        batch.max_batch_size,
    )
    return model


# A run-time load's thread runs this much nicer than the serving threads: reading and
# building a model's weights takes the cores the other models' forward passes need.
LOAD_NICENESS = 10


async def load_aside(work: Callable[..., T], *args: Any) -> T:
    """`work(*args)` on a thread of its own at LOAD_NICENESS, the event loop free meanwhile:
    a run-time load, off every other model's batching path and behind its passes for the
    cores. A thread per load, since a thread's niceness cannot be lowered back."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def run() -> None:
        with contextlib.suppress(OSError, AttributeError):  # not Linux: as it is
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOAD_NICENESS)
        try:
            result = work(*args)
        except BaseException as exc:
            loop.call_soon_threadsafe(_settle, done, None, exc)
        else:
            loop.call_soon_threadsafe(_settle, done, result, None)

    threading.Thread(target=run, name="model-load", daemon=True).start()
    return await done


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def model_bytes(model: LoadedModel) -> int:
    """What a loaded model's weights take: its torch modules' parameters and buffers, or
    an exported backend's files (ONNX Runtime and OpenVINO hold about that much)."""
    runner = model.runner
    modules = [getattr(runner.backend, "module", None), runner.projection]
    modules += [getattr(getattr(runner, "image_backend", None), "module", None)]
    total = 0
    seen: set[int] = set()
    for module in modules:
        if not isinstance(module, torch.nn.Module):
            continue
        for tensor in (*module.parameters(), *module.buffers()):
            if id(tensor) not in seen:
                seen.add(id(tensor))
                total += tensor.numel() * tensor.element_size()
    backend_file = model.info.backend_file
    if backend_file:  # the graph and its weights: model.onnx(_data), openvino_model.xml/.bin
        export = Path(backend_file)
        with contextlib.suppress(OSError):
            total += sum(p.stat().st_size for p in export.parent.glob(export.stem + "*"))
    return total


def release_memory() -> None:
    """After an unload: the model's cycles collected, the allocator's cached device blocks
    and the heap's free pages handed back, so that memory returns to where it began."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    trimmer()()


def load_engine(config: ServerConfig) -> Engine:
    models, batch = load_models(config)
    return Engine(models, config.limits, batch, config.tokenizer_threads, cache=config.cache)
