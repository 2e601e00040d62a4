"""Loading the models onto a device: batch sizes, forward workers and threads for it.

Only a process that runs models imports this (and with it torch and transformers).
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path

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
from pooling_server.engine.scheduling.batch_queue import BatchConfig
from pooling_server.engine.scheduling.engine import Engine
from pooling_server.service.ops.config import ServerConfig

log = logging.getLogger(__name__)


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
    dtype = resolve_dtype(config.dtype, device)
    batch = batch_config_for(config, device)
    cache = Path(config.backend_cache_dir).expanduser() if config.backend_cache_dir else None
    runtime = RuntimeSettings(cache_dir=cache)
    models = []
    for index, spec in enumerate(config.models):
        model = load_model(
            spec,
            device=device,
            dtype=dtype,
            attn_implementation=config.attn_implementation,
            is_default=index == 0,
            runtime=runtime,
            threads=config.intra_op_threads or _cores(config),
            cuda_graphs=graph_settings(config, batch),
        )
        info = model.info
        log.info(
            "loaded model %s (%s) on %s/%s: tasks %s, max %d tokens, pooling %s, backend %s %s%s",
            info.name,
            info.architecture,
            device,
            str(dtype).removeprefix("torch."),
            ", ".join(info.tasks),
            info.max_input_tokens,
            info.pooling_type,
            info.backend,
            info.precision,
            f" ({info.backend_file})" if info.backend_file else "",
        )
        threads = thread_share(config, device, batch.workers, info.hidden_size)
        model.runner.threads = threads
        models.append(model)
        log.info(
            "model %s: %d forward worker(s), intra-op threads %s, batches of at most %d",
            info.name,
            batch.workers,
            threads or torch.get_num_threads(),
            batch.max_batch_size,
        )
    return models, batch


def load_engine(config: ServerConfig) -> Engine:
    models, batch = load_models(config)
    return Engine(models, config.limits, batch, config.tokenizer_threads)
