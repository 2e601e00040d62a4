"""Transport settings: HTTP/2 keepalive and limits, and TLS credentials."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

# Calls accepted by gRPC core but not yet taken up by the server, server-wide. gRPC core's
# default (1,000 soft, 3,000 hard) cancels calls of an ordinary burst unseen; past this bound
# core still sheds them, which is part of its defence against rapid-reset floods.
MAX_PENDING_CALLS = 4096


@dataclass(frozen=True)
class TransportConfig:
    """HTTP/2 and gRPC channel settings; the defaults suit service meshes."""

    keepalive_time_s: float = 60.0
    keepalive_timeout_s: float = 20.0
    keepalive_permit_without_calls: bool = True
    min_client_ping_interval_s: float = 10.0
    max_concurrent_streams: int = 4096  # 0: gRPC's default (unlimited)
    max_connection_age_s: float = 1800.0  # 0: connections live forever
    max_connection_age_grace_s: float = 30.0
    gzip_responses: bool = False
    # Several server processes share one port (--frontends); otherwise a taken port is an error.
    reuse_port: bool = False

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
        options.append(("grpc.so_reuseport", int(self.reuse_port)))
        if self.max_concurrent_streams:
            options.append(("grpc.max_concurrent_streams", self.max_concurrent_streams))
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
        with open(self.key_file, "rb") as key, open(self.cert_file, "rb") as cert:
            pair = (key.read(), cert.read())
        client_ca = None
        if self.client_ca_file:
            with open(self.client_ca_file, "rb") as ca:
                client_ca = ca.read()
        return grpc.ssl_server_credentials(
            [pair], root_certificates=client_ca, require_client_auth=client_ca is not None
        )
