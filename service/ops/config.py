"""A server's configuration: ServerConfig and the settings beside it (HTTP/2 transport,
TLS, the HTTP door's limits, API keys), and the open-file limit every server process raises.

Every process of a server reads this, the engine processes included, so it imports no
grpc, no aiohttp and no torch: what needs them (TLS credentials) imports them when called.
"""

from __future__ import annotations

import logging
import resource
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pooling_server.engine.caching.cache import CacheSettings
from pooling_server.engine.models.model_spec import DEFAULT_MODEL, ModelSpec
from pooling_server.engine.requests.resolved import Limits
from pooling_server.engine.scheduling.batch_queue import BatchConfig
from pooling_server.engine.scheduling.remote_client import DEFAULT_STALL_S

if TYPE_CHECKING:
    import grpc

log = logging.getLogger(__name__)

# Calls accepted by gRPC core but not yet taken up by the server, server-wide. gRPC core's
# default (1,000 soft, 3,000 hard) cancels calls of an ordinary burst unseen; past this bound
# core still sheds them, which is part of its defence against rapid-reset floods.
MAX_PENDING_CALLS = 4096

# A request message or body this large costs a few megabytes while it is read (a copy or
# two beside it): such reads take turns, on gRPC once one has been seen
# (service/grpc/read_gate.py), on HTTP by the Content-Length declared (service/http/guard.py).
LARGE_MESSAGE_BYTES = 1 << 20

# The HTTP/2 window of a stream whose message is not being read (gRPC core's lookahead),
# so what a call waiting for its read turn may hold on the server. 4 MiB keeps a 16 MB
# upload over a 20 ms round trip as fast as gRPC core's window probing (0.18 s against
# 0.17 s; 1 MiB: 0.29 s), which would grow the window whether anyone reads or not.
UNREAD_WINDOW_BYTES = 4 << 20


@dataclass(frozen=True)
class TransportConfig:
    """HTTP/2 and gRPC channel settings; the defaults suit service meshes."""

    keepalive_time_s: float = 60.0
    keepalive_timeout_s: float = 20.0
    keepalive_permit_without_calls: bool = True
    min_client_ping_interval_s: float = 10.0
    max_concurrent_streams: int = 4096  # 0: gRPC's default (unlimited)
    # Calls open at once per front end, over every connection, their requests arrived or
    # not: a client that opens streams and never ends them holds a few KB each, so past
    # this a new call is RESOURCE_EXHAUSTED at once.
    max_open_calls: int = 32768  # 0: no limit
    max_connection_age_s: float = 1800.0  # 0: connections live forever
    max_connection_age_grace_s: float = 30.0
    # Connections open at once, lowered to a quarter of the open-file limit (the HTTP door
    # takes up to half): past it gRPC core closes new ones at once, so idle sockets cannot
    # take the descriptors the other door, the engine sockets and the logs need.
    max_connections: int = 1024
    # Of them, what one client address may hold (0: a quarter of the cap), so that sockets
    # from one address lock no other client out (the Node door; gRPC core has no such hook).
    max_connections_per_address: int = 0
    # A connection that has not begun HTTP/2 is closed; on the Node door also one that has
    # opened no call this long after it began (and a call whose request has not come).
    handshake_timeout_s: float = 10.0
    # A connection with no call for this long gets GOAWAY (clients reconnect on their next
    # call), so idle connections cannot hold the cap's slots for the half hour of their age.
    max_connection_idle_s: float = 300.0  # 0: never
    # Answers handed to HTTP/2 and not yet read by their clients, per front end over all
    # connections (each connection: at most a quarter of it, at least two messages' worth):
    # past it a large answer is RESOURCE_EXHAUSTED rather than held (small ones have a
    # reserve of a quarter more, so stalled readers cannot starve small calls).
    max_unsent_answer_bytes: int = 64 << 20
    # Request messages read at once per process while large ones come, each read holding
    # its turn at most read_turn_s (service/grpc/read_gate.py): a read costs about three times
    # its message.
    max_concurrent_reads: int = 1  # 0: no limit
    read_turn_s: float = 0.5
    gzip_responses: bool = False
    # Several server processes share one port (--frontends); otherwise a taken port is an error.
    reuse_port: bool = False
    # What serves HTTP/2 for gRPC: grpcio's asyncio server, or Node.js (service/grpc/node_door.py).
    door: str = "grpcio"

    def connection_cap(self) -> int:
        """max_connections, lowered to gRPC's share of the open-file limit (either door)."""
        return descriptor_budget("gRPC", self.max_connections, GRPC_DESCRIPTOR_SHARE)

    def address_cap(self) -> int:
        """The connections one client address may hold (the Node door enforces it)."""
        return address_share(self.max_connections_per_address, self.connection_cap())

    def options(self, max_message_bytes: int) -> list[tuple[str, int]]:
        options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.keepalive_time_ms", int(self.keepalive_time_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.keepalive_timeout_s * 1000)),
            ("grpc.keepalive_permit_without_calls", int(self.keepalive_permit_without_calls)),
            # Accept client (sidecar) pings this often without answering GOAWAY too_many_pings.
            (
                "grpc.http2.min_ping_interval_without_data_ms",
                int(self.min_client_ping_interval_s * 1000),
            ),
            ("grpc.http2.max_pings_without_data", 0),
            # See MAX_PENDING_CALLS: a burst is queued and, past --max-queued-items,
            # refused with QUEUE_FULL instead of cancelled unseen.
            ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
            ("grpc.server.max_pending_requests_hard_limit", 2 * MAX_PENDING_CALLS),
        ]
        if self.max_concurrent_reads:
            # A message waiting for its read turn stays in the client's socket beyond this.
            options.append(("grpc.http2.bdp_probe", 0))
            options.append(("grpc.http2.lookahead_bytes", UNREAD_WINDOW_BYTES))
        options.append(("grpc.so_reuseport", int(self.reuse_port)))
        options.append(("grpc.server_handshake_timeout_ms", int(self.handshake_timeout_s * 1000)))
        options.append(("grpc.max_allowed_incoming_connections", self.connection_cap()))
        if self.max_concurrent_streams:
            options.append(("grpc.max_concurrent_streams", self.max_concurrent_streams))
        if self.max_connection_idle_s:
            options.append(("grpc.max_connection_idle_ms", int(self.max_connection_idle_s * 1000)))
        if self.max_connection_age_s:
            options.append(("grpc.max_connection_age_ms", int(self.max_connection_age_s * 1000)))
            options.append(
                ("grpc.max_connection_age_grace_ms", int(self.max_connection_age_grace_s * 1000))
            )
        return options


@dataclass(frozen=True)
class TlsConfig:
    cert_file: str
    key_file: str
    client_ca_file: str | None = None  # set: mutual TLS, clients must present a certificate

    def credentials(self) -> grpc.ServerCredentials:
        import grpc

        with open(self.key_file, "rb") as key, open(self.cert_file, "rb") as cert:
            pair = (key.read(), cert.read())
        client_ca = None
        if self.client_ca_file:
            with open(self.client_ca_file, "rb") as ca:
                client_ca = ca.read()
        return grpc.ssl_server_credentials(
            [pair], root_certificates=client_ca, require_client_auth=client_ca is not None
        )


@dataclass(frozen=True)
class HttpLimits:
    """What the HTTP door allows a connection (service/http/guard.py enforces them); README
    "HTTP API" gives the reasons."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 10.0
    body_min_bytes_per_s: int = 16 * 1024
    keepalive_timeout_s: float = 75.0
    max_connections: int = 1024
    max_connections_per_address: int = 0  # 0: a quarter of max_connections
    max_concurrent_bodies: int = 3


@dataclass(frozen=True)
class BatchJobOptions:
    """`pooling-server batch`'s own settings (the server's flags apply beside them)."""

    input: str  # a path, or "-" for stdin
    output: str  # a path, or "-" for stdout
    resume: bool = False
    window: int = 512  # lines in flight: enough to fill batches of the largest size
    progress: bool | None = None  # None: when stderr is a terminal
    ray: RayJobOptions | None = None  # --ray: on a Ray cluster (service/ray_batch.py)


@dataclass(frozen=True)
class RayJobOptions:
    """`pooling-server batch --ray`'s own settings."""

    address: str = "local"  # "local": start a Ray here; else a cluster's ("auto", ray://...)
    actors: int = 1
    cpus_per_actor: float = 1.0
    gpus_per_actor: float = 0.0
    in_flight_shards: int = 4  # per actor, so its batching queue stays full
    shard_lines: int = 1024  # lines a shard: enough to fill batches, few to answer again
    input_format: str = "batch"  # batch (OpenAI lines), or a dataset: jsonl or parquet
    text_column: str = "text"
    id_column: str | None = None  # datasets: the rows' ids, for --resume
    task: str = "embed"  # datasets: what each row asks
    dimensions: int | None = None


@dataclass
class ServerConfig:
    models: Sequence[ModelSpec] = field(default_factory=lambda: [ModelSpec(DEFAULT_MODEL)])
    host: str = "127.0.0.1"
    port: int = 50051
    device: str = "auto"
    dtype: str = "auto"
    attn_implementation: str | None = None
    cuda_graphs: bool = True  # --cuda-graphs: CUDA graphs for the torch forward on a GPU
    torch_threads: int | None = None  # None: on CPU, the cores shared among forward workers
    intra_op_threads: int | None = None  # onnx and openvino; None: torch_threads, else cores
    backend_cache_dir: str | None = None  # None: engine.backends.default_cache_dir()
    tokenizer_threads: int = 1
    limits: Limits = field(default_factory=Limits)
    # Zeros are filled in for the device by batch_config_for.
    batch: BatchConfig = field(default_factory=lambda: BatchConfig(max_batch_size=0, workers=0))
    max_stream_inflight: int = 256
    drain_delay_s: float = 0.0
    shutdown_grace_s: float = 30.0
    max_message_bytes: int = 16 * 1024 * 1024
    max_http_response_bytes: int = 64 * 1024 * 1024  # the HTTP API's largest response body
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None
    http_port: int | None = None  # the HTTP API (service/http/app.py) on --host; None: off
    http: HttpLimits = field(default_factory=HttpLimits)  # its timeouts and caps
    cohere_input_type_prompts: Sequence[str] = ()  # --cohere-input-type-prompt TYPE=NAME
    transport: TransportConfig = field(default_factory=TransportConfig)
    tls: TlsConfig | None = None
    api_keys: Sequence[str] = ()
    # The result cache (docs/cache.md): its tiers (--cache-mb, --cache-redis...), and whose
    # entries a call may read with --api-key (--cache-scope: "key", each key its own; or
    # "shared").
    cache: CacheSettings = field(default_factory=CacheSettings)
    cache_scope: str = "key"
    otlp_endpoint: str | None = None
    log_inputs: bool = False
    log_requests: bool = False
    frontends: int = 0  # front-end processes beside engine processes; 0: all in this one
    data_parallel: int = 1  # devices, each served by engines_per_device engine processes
    engines_per_device: int = 1
    engine_stall_s: float = (
        DEFAULT_STALL_S  # a front end's stall check (engine/scheduling/remote_client.py); 0: off
    )
    # Models managed at run time (service/repository.py): the ModelRepository service and
    # /v2/repository routes are served only with an admin key; --model-repository names
    # what may load on demand; 0 and None: no bound.
    admin_keys: Sequence[str] = ()
    model_repository: str | None = None
    max_loaded_models: int = 0
    model_memory_bytes: int = 0
    failed_load_ttl_s: float = 30.0


def load_keys(keys: Iterable[str], key_file: str | None) -> list[str]:
    """API keys from the command line and from a file of one key per line (# comments
    allowed); service/ops/auth.py checks them."""
    found = [key for key in keys if key]
    if key_file:
        for line in Path(key_file).read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                found.append(line)
    return found


# What each door may hold of the open-file limit: 1/2 for HTTP, 1/4 for gRPC; the rest is
# for the engine sockets, model files and logs.
HTTP_DESCRIPTOR_SHARE = 2
GRPC_DESCRIPTOR_SHARE = 4


def descriptor_budget(door: str, requested: int, share: int) -> int:
    """`requested` connections for `door`, lowered (with a warning) to 1/`share` of the
    open-file limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or requested <= soft // share:
        return requested
    budget = max(1, soft // share)
    log.warning(
        "%s connection cap lowered from %d to %d: 1/%d of the open-file limit (%d)",
        door,
        requested,
        budget,
        share,
        soft,
    )
    return budget


# What one client address may hold of a door's connections when no share is given.
ADDRESS_SHARE = 4


def address_share(requested: int, cap: int) -> int:
    """Connections one client address may hold: `requested` (0: 1/ADDRESS_SHARE of `cap`),
    never more than `cap`."""
    return min(cap, requested or max(1, cap // ADDRESS_SHARE))


def raise_open_file_limit() -> None:
    """Raise RLIMIT_NOFILE's soft limit to the hard one (systemd's soft default is 1024)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard or soft == resource.RLIM_INFINITY:
        log.info("open-file limit %s (the hard limit)", _limit(soft))
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:
        log.warning("open-file limit %s: cannot raise it to %s (%s)", soft, _limit(hard), exc)
        return
    log.info("open-file limit raised from %d to %s (the hard limit)", soft, _limit(hard))


def _limit(value: int) -> str:
    return "unlimited" if value == resource.RLIM_INFINITY else str(value)
