"""Connection settings shared by the sync and async clients.

Holds what the constructor arguments decide (TLS or not, channel options, per-call metadata,
default model and timeout) so both clients resolve them the same way.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

MetadataPairs = Sequence[tuple[str, str]]
MetadataArg = MetadataPairs | Callable[[], MetadataPairs] | None

#: Spread calls over every address a target resolves to, skip replicas whose health service
#: says NOT_SERVING (a draining server says so before it stops accepting calls), and retry
#: calls that found a replica going away on another one: UNAVAILABLE, or CANCELLED, which
#: grpcio gives a call that reached a server as it stopped or died (grpc/grpc#41785). Every
#: Pooling RPC is a pure function, so a retry is safe; a call this client cancels is not
#: retried (gRPC's retry layer drops a call cancelled by its application).
SERVICE_CONFIG = json.dumps(
    {
        "loadBalancingConfig": [{"round_robin": {}}],
        "healthCheckConfig": {"serviceName": "pooling.v1.PoolingService"},
        "methodConfig": [
            {
                "name": [{"service": "pooling.v1.PoolingService"}],
                "retryPolicy": {
                    "maxAttempts": 5,
                    "initialBackoff": "0.05s",
                    "maxBackoff": "1s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE", "CANCELLED"],
                },
            }
        ],
    }
)

#: Channel options applied unless the caller sets the same key. Token matrices of a large
#: batch easily pass gRPC's default 4 MiB receive limit, so the client accepts any size and
#: leaves limits to the server.
DEFAULT_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.max_receive_message_length", -1),
    ("grpc.service_config", SERVICE_CONFIG),
    ("grpc.enable_retries", 1),
)


def channel_target(target: str | Sequence[str]) -> str:
    """One gRPC target for one address, a DNS name (all its addresses), or several replicas.

    Several replicas must be IP addresses (gRPC's static `ipv4:`/`ipv6:` lists); for host
    names, use one DNS name that resolves to every replica (a headless Service).
    """
    if isinstance(target, str):
        return target
    targets = list(target)
    if len(targets) == 1:
        return targets[0]
    families = {_ip_family(t) for t in targets}
    if len(families) != 1 or None in families:
        raise ValueError(
            "several targets must all be IPv4 or all IPv6 addresses with ports; for host names "
            "use one DNS name that resolves to every replica"
        )
    return f"{families.pop()}:{','.join(targets)}"


def _ip_family(address: str) -> str | None:
    host = address.rsplit(":", 1)[0].strip("[]")
    try:
        return f"ipv{ipaddress.ip_address(host).version}"
    except ValueError:
        return None


def channel_credentials(
    credentials: grpc.ChannelCredentials | None,
    root_certificates: bytes | None,
    private_key: bytes | None,
    certificate_chain: bytes | None,
) -> grpc.ChannelCredentials | None:
    """TLS credentials when any TLS argument is given, else None (an insecure channel)."""
    pem = (root_certificates, private_key, certificate_chain)
    if credentials is not None:
        if any(part is not None for part in pem):
            raise ValueError(
                "Pass either credentials or root_certificates/private_key/certificate_chain"
            )
        return credentials
    if all(part is None for part in pem):
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=root_certificates,
        private_key=private_key,
        certificate_chain=certificate_chain,
    )


def channel_options(options: Sequence[tuple[str, Any]] | None) -> list[tuple[str, Any]]:
    """The caller's options plus any :data:`DEFAULT_OPTIONS` they did not set."""
    merged = list(options or ())
    keys = {key for key, _ in merged}
    merged.extend(option for option in DEFAULT_OPTIONS if option[0] not in keys)
    return merged


@dataclass(frozen=True)
class ClientConfig:
    """Per-call defaults: model, timeout and the metadata sent with every call."""

    model: str | None = None
    timeout: float | None = None
    metadata: MetadataArg = None
    api_key: str | None = None

    def model_for(self, model: str | None) -> str | None:
        """The per-call model if given, else the client's default (None: server default)."""
        return model if model is not None else self.model

    def timeout_for(self, timeout: float | None) -> float | None:
        """The per-call timeout if given, else the client's default."""
        return timeout if timeout is not None else self.timeout

    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        """Metadata for one call; a callable is re-evaluated each call (e.g. rotating tokens)."""
        metadata = self.metadata() if callable(self.metadata) else self.metadata
        pairs = tuple(metadata or ())
        if self.api_key is not None:
            pairs += (("authorization", f"Bearer {self.api_key}"),)
        return pairs
