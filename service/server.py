"""Server lifecycle: listen, load models, report health, drain on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry import trace

from engine.batch_queue import BatchConfig
from engine.engine import Engine
from engine.loader import DEFAULT_MODEL, ModelSpec, load_model, resolve_device, resolve_dtype
from engine.model_runner import ThreadShare
from engine.validation import Limits
from pooling_client.v1 import pooling_pb2
from service.auth import BearerTokenInterceptor
from service.handlers import add_pooling_service
from service.health import HealthServicer
from service.metrics import Metrics
from service.servicer import PoolingServicer
from service.telemetry import Telemetry
from service.telemetry import tracer_provider as make_tracer_provider
from service.transport import TlsConfig, TransportConfig

log = logging.getLogger(__name__)

SERVICE_NAME = pooling_pb2.DESCRIPTOR.services_by_name["PoolingService"].full_name
HEALTH_NAMES = ("", SERVICE_NAME)


@dataclass
class ServerConfig:
    models: Sequence[ModelSpec] = field(default_factory=lambda: [ModelSpec(DEFAULT_MODEL)])
    host: str = "127.0.0.1"
    port: int = 50051
    device: str = "auto"
    dtype: str = "auto"
    attn_implementation: str | None = None
    torch_threads: int | None = None  # None: on CPU, the cores shared among forward workers
    tokenizer_threads: int = 1
    limits: Limits = field(default_factory=Limits)
    # Zeros are filled in for the device by batch_config_for.
    batch: BatchConfig = field(default_factory=lambda: BatchConfig(max_batch_size=0, workers=0))
    max_stream_inflight: int = 256
    drain_delay_s: float = 0.0
    shutdown_grace_s: float = 30.0
    max_message_bytes: int = 16 * 1024 * 1024
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None
    transport: TransportConfig = field(default_factory=TransportConfig)
    tls: TlsConfig | None = None
    api_keys: Sequence[str] = ()
    otlp_endpoint: str | None = None
    log_inputs: bool = False
    log_requests: bool = False


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


def load_engine(config: ServerConfig) -> Engine:
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    batch = batch_config_for(config, device)
    models = []
    for index, spec in enumerate(config.models):
        model = load_model(
            spec,
            device=device,
            dtype=dtype,
            attn_implementation=config.attn_implementation,
            is_default=index == 0,
        )
        info = model.info
        log.info(
            "loaded model %s (%s) on %s/%s: tasks %s, max %d tokens, pooling %s",
            info.name,
            info.architecture,
            device,
            str(dtype).removeprefix("torch."),
            ", ".join(info.tasks),
            info.max_input_tokens,
            info.pooling_type,
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
    return Engine(models, config.limits, batch, config.tokenizer_threads)


class PoolingServer:
    """A gRPC server whose health turns SERVING only once every model is loaded and warm."""

    def __init__(
        self, config: ServerConfig, tracer_provider: trace.TracerProvider | None = None
    ) -> None:
        self.config = config
        self.metrics = Metrics()
        telemetry = Telemetry(
            self.metrics,
            tracer_provider or make_tracer_provider(config.otlp_endpoint),
            config.log_inputs,
            config.log_requests,
        )
        self.servicer = PoolingServicer(telemetry, config.max_stream_inflight)
        self.health = HealthServicer()
        interceptors: list[grpc.aio.ServerInterceptor] = []
        if config.api_keys:
            interceptors.append(BearerTokenInterceptor(config.api_keys))
        self.server = grpc.aio.server(
            interceptors=interceptors,
            options=config.transport.options(config.max_message_bytes),
            compression=grpc.Compression.Gzip if config.transport.gzip_responses else None,
        )
        add_pooling_service(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server
        )
        self.port = 0

    async def _set_health(self, status: int) -> None:
        for name in HEALTH_NAMES:
            await self.health.set(name, status)

    async def start(self) -> None:
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.config.transport.reuse_port:
            # One of several processes on the port (--processes): join it only once able
            # to serve, so the kernel never hands a connection to a process still loading.
            await self._load()
            await self._listen()
        else:
            await self._listen()
            await self._load()
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        log.info("serving on port %d", self.port)

    async def _listen(self) -> None:
        address = f"{self.config.host}:{self.config.port}"
        try:
            if self.config.tls is None:
                self.port = self.server.add_insecure_port(address)
            else:
                self.port = self.server.add_secure_port(address, self.config.tls.credentials())
        except RuntimeError as exc:  # grpcio raises where older versions returned 0
            raise RuntimeError(f"cannot listen on {address}: is the port taken?") from exc
        if not self.port:
            raise RuntimeError(f"cannot listen on {address}: is the port taken?")
        await self.server.start()
        if self.config.metrics_port is not None:
            self.metrics.serve(self.config.metrics_host, self.config.metrics_port)
            log.info(
                "metrics on http://%s:%d/metrics",
                self.config.metrics_host,
                self.config.metrics_port,
            )
        log.info("listening on %s:%d", self.config.host, self.port)

    async def _load(self) -> None:
        engine = await asyncio.to_thread(load_engine, self.config)
        await engine.start()
        self.metrics.attach(engine)
        self.servicer.engine = engine
        log.info("loaded %d model(s)", len(engine.model_infos))

    async def stop(self) -> None:
        """Drain: NOT_SERVING first, then stop accepting and finish what was accepted."""
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.config.drain_delay_s:
            await asyncio.sleep(self.config.drain_delay_s)
        self.health.close_watches()
        await self.server.stop(self.config.shutdown_grace_s)
        if self.servicer.engine is not None:
            await self.servicer.engine.stop()
        log.info("stopped")


async def serve(config: ServerConfig) -> int:
    server = PoolingServer(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    starting = asyncio.create_task(server.start())
    await asyncio.wait({starting, asyncio.create_task(stop.wait())}, return_when="FIRST_COMPLETED")
    if starting.done():
        starting.result()
        await stop.wait()
    else:
        starting.cancel()
    log.info("shutting down")
    await server.stop()
    return 0
