"""Server lifecycle: listen, load models, report health, drain on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import gc
import ipaddress
import logging
import os
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc
from opentelemetry import trace

from pooling_server.engine.scheduling.batch_queue import BatchQueue
from pooling_server.engine.scheduling.engine import Engine
from pooling_server.engine.scheduling.remote_client import RemoteEngineClient
from pooling_server.service.cache_control import CacheControl
from pooling_server.service.grpc.handlers import add_pooling_service
from pooling_server.service.grpc.health import HealthServicer
from pooling_server.service.grpc.node_door import (
    HandlerSet,
    NodeDoor,
    open_call_caps,
    unary_request_paths,
)
from pooling_server.service.grpc.read_gate import ReadGate
from pooling_server.service.grpc.repository import SERVICE as REPOSITORY_SERVICE
from pooling_server.service.grpc.repository import RepositoryServicer, add_repository_service
from pooling_server.service.grpc.servicer import PoolingServicer
from pooling_server.service.grpc.stream_limit import AnswerBudget, unsent_per_connection
from pooling_server.service.http.app import HttpApi
from pooling_server.service.http.cohere import input_type_prompts
from pooling_server.service.ops.auth import BearerTokenInterceptor
from pooling_server.service.ops.config import LARGE_MESSAGE_BYTES, MAX_PENDING_CALLS, ServerConfig
from pooling_server.service.ops.event_loop import loop_name
from pooling_server.service.ops.memory import trimmer
from pooling_server.service.ops.metrics import Metrics
from pooling_server.service.ops.telemetry import Telemetry
from pooling_server.service.ops.telemetry import tracer_provider as make_tracer_provider
from pooling_server.service.proto import pooling_pb2
from pooling_server.service.repository import (
    LocalHost,
    ModelHost,
    ModelManager,
    RemoteHost,
    RepositoryMetrics,
)
from pooling_server.service.runner import RequestRunner
from pooling_server.service.split.frontend import FrontendRole, connect_engine
from pooling_server.service.split.layout import weight_bytes

log = logging.getLogger(__name__)

SERVICE = pooling_pb2.DESCRIPTOR.services_by_name["PoolingService"]
SERVICE_NAME = SERVICE.full_name
HEALTH_NAMES = ("", SERVICE_NAME)
REFLECTED = (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME)


class PoolingServer:
    """A gRPC server whose health turns SERVING only once every model is loaded and warm."""

    def __init__(
        self,
        config: ServerConfig,
        tracer_provider: trace.TracerProvider | None = None,
        frontend: FrontendRole | None = None,
    ) -> None:
        self.config = config
        self.frontend = frontend
        if frontend is not None:
            frontend.on_engines_changed = self._engines_changed
        self.metrics = Metrics(multiprocess=frontend is not None)
        telemetry = Telemetry(
            self.metrics,
            tracer_provider or make_tracer_provider(config.otlp_endpoint),
            config.log_inputs,
            config.log_requests,
        )
        self.runner = RequestRunner(telemetry)
        if config.cache.enabled:
            self.runner.cache = CacheControl(config)
        self.servicer = PoolingServicer(self.runner, config.max_stream_inflight)
        # Models loaded at run time: served only with an admin key (docs/model-repository.md).
        self.repository = (
            RepositoryServicer(self.runner, config.admin_keys) if config.admin_keys else None
        )
        self.health = HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.door: NodeDoor | None = None
        if config.transport.door == "node":
            self.door = self._node_door()
        else:
            self.server = self._grpcio_server()
        self.port = 0
        self.grace_ran_out = False  # set by stop(): accepted calls were cancelled
        self.serving = False  # between start-up and the drain: health follows the engines
        self.door_failed = False  # the Node.js door exited on its own
        self.http: HttpApi | None = None
        self.http_port = 0
        if config.http_port is not None:
            self.http = HttpApi(self.runner, config.api_keys)
            self.http.cohere_prompts = input_type_prompts(config.cohere_input_type_prompts)
            self.http.max_response_bytes = config.max_http_response_bytes
            self.http.admin_keys = config.admin_keys

    def _grpcio_server(self) -> grpc.aio.Server:
        config, transport = self.config, self.config.transport
        interceptors: list[grpc.aio.ServerInterceptor] = []
        if config.api_keys:
            interceptors.append(BearerTokenInterceptor(config.api_keys))
        server = grpc.aio.server(
            interceptors=interceptors,
            options=grpcio_options(config),
            compression=grpc.Compression.Gzip if transport.gzip_responses else None,
            maximum_concurrent_rpcs=transport.max_open_calls or None,
        )
        gate = ReadGate(
            transport.max_concurrent_reads, transport.read_turn_s, after_large=trimmer()
        )
        answers = AnswerBudget(
            transport.max_unsent_answer_bytes,
            unsent_per_connection(transport, config.max_message_bytes),
            LARGE_MESSAGE_BYTES,
            copies=2,
        )
        add_pooling_service(self.servicer, server, gate, answers, transport.handshake_timeout_s)
        if self.repository is not None:
            add_repository_service(self.repository, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(REFLECTED, server)
        return server

    def _node_door(self) -> NodeDoor:
        """The same handlers on Node's HTTP/2 server. Node reads large messages in turns
        itself, so the gate here takes none: it only trims after a large one."""
        handlers = HandlerSet()
        add_pooling_service(self.servicer, handlers, ReadGate(0, 0.0, after_large=trimmer()))
        if self.repository is not None:
            add_repository_service(self.repository, handlers)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, handlers)
        reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
            reflection.aio.ReflectionServicer(REFLECTED), handlers
        )
        whole = unary_request_paths(
            SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"], REPOSITORY_SERVICE
        )
        return NodeDoor(self.config, handlers, whole, self._door_exited)

    def _door_exited(self, code: int) -> None:
        """Node died under the server: no gRPC call can be served; stop, exit non-zero."""
        self.door_failed = True
        os.kill(os.getpid(), signal.SIGTERM)

    async def _set_health(self, status: int) -> None:
        if self.http is not None:
            self.http.serving = status == health_pb2.HealthCheckResponse.SERVING
        for name in HEALTH_NAMES:
            await self.health.set(name, status)

    async def start(self) -> None:
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self._listen()
        await self._load()
        if self.frontend is not None:
            await self.frontend.all_ready()
        self.serving = True
        self._observe_engines()
        await self._set_health(self._engine_status())
        log.info("serving on port %d", self.port)

    async def _listen(self) -> None:
        if self.door is not None:
            self.port = await self.door.start()
        else:
            await self._start_grpcio()
        if self.config.metrics_port is not None:
            self.metrics.serve(self.config.metrics_host, self.config.metrics_port)
            log.info(
                "metrics on http://%s:%d/metrics",
                self.config.metrics_host,
                self.config.metrics_port,
            )
        log.info(
            "listening on %s:%d (%s event loop), gRPC served by %s",
            self.config.host,
            self.port,
            loop_name(),
            self.config.transport.door,
        )
        if self.http is not None and self.config.http_port is not None:
            self.http_port = await self.http.start(
                self.config.host,
                self.config.http_port,
                self.config.transport.reuse_port,
                self.config.max_message_bytes,
                self.config.http,
            )
            log.info("HTTP API on http://%s:%d", self.config.host, self.http_port)

    async def _start_grpcio(self) -> None:
        assert self.server is not None
        warn_if_exposed(self.config.host)
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

    async def _load(self) -> None:
        if self.frontend is None:
            from pooling_server.service.loading import (
                load_engine,  # torch and transformers: only here
            )

            engine = await asyncio.to_thread(load_engine, self.config)
        else:
            await self.frontend.engines_ready()
            engine = connect_engine(self.config, self.frontend)
        await engine.start()
        self.metrics.attach(engine)
        self.runner.repository = self._model_manager(engine)
        self.runner.engine = engine
        log.info("loaded %d model(s)", len(engine.model_infos))

    def _model_manager(self, engine: Engine) -> ModelManager | None:
        """Models loaded at run time: with an admin key or a repository, else none (and no
        cost on any call)."""
        config = self.config
        if not (config.admin_keys or config.model_repository):
            return None
        metrics = RepositoryMetrics(self.metrics.registry)

        def observe(name: str, queue: BatchQueue) -> None:
            self.metrics.utilization.track(name, queue.config)
            queue.observers.append(self.metrics.observe_batch)

        if self.frontend is None:
            from pooling_server.service.loading import model_bytes  # torch: only here

            host: ModelHost = LocalHost(config, engine, observe)
            names = [info.name for info in engine.model_infos]
            sizes = {name: model_bytes(engine.model_named(name)) for name in names}  # type: ignore[arg-type]
        else:
            host = RemoteHost(engine, config.engines_per_device)
            # The engines hold the --model models: their weight files, as near as is known.
            sizes = {spec.served_name: weight_bytes([spec.source]) for spec in config.models}
        # The --adapter adapters: their matrices, as their files hold them.
        sizes |= {
            name: weight_bytes([path]) for spec in config.models for name, path in spec.adapters
        }
        manager = ModelManager(config, engine, host, metrics, sizes)
        if self.frontend is not None:  # the other front ends' loads and unloads, told here
            engine.client.on_model_changed = manager.learned  # type: ignore[attr-defined]
        return manager

    def _remote_client(self) -> RemoteEngineClient | None:
        client = self.runner.engine.client if self.runner.engine is not None else None
        return client if isinstance(client, RemoteEngineClient) else None

    def _engine_status(self) -> int:
        """SERVING while some engine can serve: always in one process; in a split server
        while an engine process is neither dead nor stalled."""
        client = self._remote_client()
        serving = client is None or client.serving
        health = health_pb2.HealthCheckResponse
        return health.SERVING if serving else health.NOT_SERVING

    def _observe_engines(self) -> None:
        client = self._remote_client()
        if client is not None:
            self.metrics.observe_engines(client.stalled, client.stalls)

    def _engines_changed(self) -> None:
        """An engine process died, stalled or came back (calls waiting on a dead one have
        failed; the supervisor stops the server once none is left)."""
        self._observe_engines()
        if self.serving:
            self._health_change = asyncio.ensure_future(self._set_health(self._engine_status()))

    async def stop(self) -> None:
        """Drain: NOT_SERVING first, then stop accepting and finish what was accepted."""
        self.serving = False
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.config.drain_delay_s:
            await asyncio.sleep(self.config.drain_delay_s)
        self.health.close_watches()
        stopping = [self._stop_grpc()]
        if self.http is not None:
            stopping.append(self._stop_http())
        await asyncio.gather(*stopping)
        if self.runner.engine is not None:
            await self.runner.engine.stop()
        log.info("stopped")

    async def _stop_grpc(self) -> None:
        """grpcio cancels whatever still runs when the grace runs out: that is a loss, and
        the exit code says so (serve returns 1). With no grace, nothing tells."""
        grace = self.config.shutdown_grace_s
        if self.door is not None:
            ran_out = await self.door.stop(grace)
        else:
            assert self.server is not None
            started = asyncio.get_running_loop().time()
            await self.server.stop(grace)
            ran_out = grace > 0 and asyncio.get_running_loop().time() - started >= grace
        if ran_out:
            self.grace_ran_out = True
            log.error("--shutdown-grace-s %g ran out: calls still running were cancelled", grace)

    async def _stop_http(self) -> None:
        """As _stop_grpc: HTTP requests still running when the grace ends are cut, a loss."""
        assert self.http is not None
        grace = self.config.shutdown_grace_s
        if await self.http.stop(grace):
            self.grace_ran_out = True
            log.error("--shutdown-grace-s %g ran out: HTTP requests still running were cut", grace)


# The most streams one grpcio connection may open. gRPC core queues calls its server has not
# yet taken up, and cancels new ones past that queue's bound (MAX_PENDING_CALLS, twice it
# at most): 8 connections of 4,096 half-open streams filled it, and the bystander's calls
# were CANCELLED. At this many, 16 connections fill no more than its first bound.
GRPCIO_CONNECTION_STREAMS = MAX_PENDING_CALLS // 16


def grpcio_options(config: ServerConfig) -> list[tuple[str, int]]:
    """The transport's options for grpcio, a connection's streams capped at its share of
    --max-open-calls (as on the Node door) and at GRPCIO_CONNECTION_STREAMS, so that a few
    connections of half-open streams cannot take every open call nor core's call queue."""
    options = config.transport.options(config.max_message_bytes)
    share = open_call_caps(config.transport.max_open_calls)["per_connection"]
    limits = [value for key, value in options if key == "grpc.max_concurrent_streams"]
    limits += [share or GRPCIO_CONNECTION_STREAMS, GRPCIO_CONNECTION_STREAMS]
    options = [(key, value) for key, value in options if key != "grpc.max_concurrent_streams"]
    options.append(("grpc.max_concurrent_streams", min(limits)))
    return options


def warn_if_exposed(host: str) -> bool:
    """grpcio's door listening beyond loopback: say once what gRPC core leaves undefended
    and what defends it. Whether it warned."""
    if _loopback(host):
        return False
    log.warning(
        "gRPC served by grpcio on %s, beyond loopback: gRPC core gives connections no share "
        "per client address, answers corrupt compression and an unknown grpc-encoding with "
        "INTERNAL, never cuts a CONTINUATION flood and sends no GOAWAY for rapid reset. "
        "Serve untrusted clients with --grpc-door node, or behind Envoy (docs/reliability.md, "
        '"What grpcio\'s door cannot defend")',
        host,
    )
    return True


def _loopback(host: str) -> bool:
    """Whether `host` listens on loopback only (a name: only "localhost" is taken as one)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


async def serve(config: ServerConfig, frontend: FrontendRole | None = None) -> int:
    server = PoolingServer(config, frontend=frontend)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # A front end starts with both blocked (supervisor.py): one that came during start-up
    # was held, and starts the drain now.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})
    starting = asyncio.create_task(server.start())
    await asyncio.wait({starting, asyncio.create_task(stop.wait())}, return_when="FIRST_COMPLETED")
    if starting.done():
        starting.result()
        await stop.wait()
    else:
        starting.cancel()
    log.info("shutting down")
    await server.stop()
    # Drained. Closing the loop restores the default handlers, and a second signal (the
    # supervisor forwards the one this process got itself) must not kill the exit.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    gc.freeze()  # the process exits next: skip collecting torch's object graph (seconds)
    return 1 if server.grace_ran_out or server.door_failed else 0
