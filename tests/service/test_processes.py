"""--processes: whole servers sharing one port, spread by the kernel, stopped together."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from pooling_client import PoolingClient
from tests.metrics_endpoint import metric_sum, scrape
from tests.server_process import ServerProcess, free_port, start_server

WAIT_S = 120.0


def _free_port_pair() -> int:
    """A port whose next port is free too (child k serves metrics on base + k)."""
    for _ in range(50):
        base = free_port()
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", base + 1))
            except OSError:
                continue
        return base
    raise RuntimeError("no two adjacent free ports")


def _wait_all_loaded(ports: list[int]) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            if all(metric_sum(scrape(port), "pooling_models_loaded") == 1 for port in ports):
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError("not every server process loaded its model")


@pytest.fixture
def two_processes(
    model_folders: dict[str, Path], tmp_path: Path
) -> Iterator[tuple[ServerProcess, list[int]]]:
    metrics = _free_port_pair()
    model = f"tiny-bert={model_folders['tiny-bert']}"
    args = ["--model", model, "--processes", "2", "--metrics-port", str(metrics)]
    server = start_server(args, tmp_path, "processes")
    try:
        _wait_all_loaded([metrics, metrics + 1])
        yield server, [metrics, metrics + 1]
    finally:
        server.stop(signal.SIGKILL)
        for child in psutil.Process().children(recursive=True):
            if child.pid != server.process.pid and child.ppid() == server.process.pid:
                child.kill()


def test_connections_spread_over_the_processes_and_sigterm_stops_all(
    two_processes: tuple[ServerProcess, list[int]],
) -> None:
    server, metrics_ports = two_processes
    children = psutil.Process(server.process.pid).children()
    assert len(children) == 2
    calls = 24
    for i in range(calls):  # each client its own connection, as separate callers have
        options = [("grpc.use_local_subchannel_pool", 1)]
        with PoolingClient(server.address, options=options) as client:
            assert len(client.embed([f"text {i}"])[0].outputs.embedding) > 0
    served = [
        metric_sum(scrape(port), "pooling_requests_total", code="OK") for port in metrics_ports
    ]
    assert sum(served) == calls
    assert all(count > 0 for count in served), f"the kernel sent every connection to one: {served}"

    assert server.stop(signal.SIGTERM) == 0
    assert not any(child.is_running() for child in children)


def test_one_process_dying_stops_the_rest(two_processes: tuple[ServerProcess, list[int]]) -> None:
    server, _ = two_processes
    first, second = psutil.Process(server.process.pid).children()
    first.kill()
    assert server.process.wait(WAIT_S) != 0
    assert not second.is_running()


def test_processes_need_a_fixed_port() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "service.cli", "--processes", "2", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert result.returncode != 0
    assert "--processes needs a fixed --port" in result.stderr


def test_without_processes_a_taken_port_is_an_error(
    model_folders: dict[str, Path], tmp_path: Path
) -> None:
    """SO_REUSEPORT is on only for --processes: two servers must not share a port by mistake."""
    model = f"tiny-bert={model_folders['tiny-bert']}"
    first = start_server(["--model", model], tmp_path, "first")
    try:
        result = subprocess.run(
            [sys.executable, "-m", "service.cli", "--model", model, "--port", str(first.port)],
            capture_output=True,
            text=True,
            timeout=WAIT_S,
        )
        assert result.returncode != 0
        assert "cannot listen" in result.stderr
    finally:
        first.stop()
