"""Load a gRPC unary method with h2load: one fixed request on C concurrent HTTP/2 streams.

The Python load generator spends 0.25-0.4 ms of CPU per call, which on a small machine the
server cannot have. h2load (nghttp2, in C) sends the same framed request for a tenth of that,
which leaves the server as the thing measured. h2load knows HTTP/2, not
gRPC: it counts HTTP status 200 as success even when the grpc-status trailer says otherwise, so
callers check one real gRPC call before loading (and the server's own counters after).

Install: apt-get install nghttp2-client (Debian/Ubuntu).
"""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from google.protobuf.message import Message

from benchmarks.processes import ProcessCpu

H2LOAD = "h2load"
# Window edges kept clear of h2load's phase changes when sampling CPU.
MARGIN_S = 0.3


def grpc_body(request: Message) -> bytes:
    """A gRPC length-prefixed message: flag byte 0 (uncompressed), 4-byte big-endian length."""
    payload = request.SerializeToString()
    return b"\x00" + struct.pack(">I", len(payload)) + payload


def split_concurrency(concurrency: int, max_connections: int) -> tuple[int, int]:
    """(connections, streams per connection) with connections * streams == concurrency.

    A few connections with many streams each is how gRPC clients behave (one channel per
    process), and grpcio serves it better (the floor: 8 x 8 beat 64 x 1 and 1 x 64); the most
    connections <= max_connections that divide the concurrency exactly.
    """
    connections = max(
        c for c in range(1, min(concurrency, max_connections) + 1) if not concurrency % c
    )
    return connections, concurrency // connections


def available() -> bool:
    return shutil.which(H2LOAD) is not None


_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1000.0}


def _ms(text: str) -> float:
    match = re.fullmatch(r"([\d.]+)(us|ms|s)", text)
    if not match:
        raise ValueError(f"not an h2load duration: {text!r}")
    return float(match.group(1)) * _UNITS[match.group(2)]


def parse_output(text: str) -> dict[str, float]:
    """The figures of h2load's summary; raises if a line is missing (h2load failed)."""
    out: dict[str, float] = {}
    finished = re.search(r"^finished in [\d.]+m?s, ([\d.]+) req/s", text, re.M)
    requests = re.search(
        r"^requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, (\d+) failed, "
        r"(\d+) errored, (\d+) timeout",
        text,
        re.M,
    )
    codes = re.search(r"^status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx", text, re.M)
    traffic = re.search(r"^traffic: .*?, ([\d.]+\w*) \((\d+)\) data", text, re.M)
    timing = re.search(r"^time for request:\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)", text, re.M)
    if not (finished and requests and codes and timing):
        raise RuntimeError(f"could not parse h2load output:\n{text}")
    out["requests_per_s"] = float(finished.group(1))
    for key, value in zip(
        ("total", "started", "done", "succeeded", "failed", "errored", "timeout"),
        requests.groups(),
        strict=True,
    ):
        out[key] = int(value)
    for key, value in zip(("2xx", "3xx", "4xx", "5xx"), codes.groups(), strict=True):
        out[f"status_{key}"] = int(value)
    if traffic and out["done"]:
        out["data_bytes_per_response"] = int(traffic.group(2)) / out["done"]
    for key, value in zip(("min_ms", "max_ms", "mean_ms", "sd_ms"), timing.groups(), strict=True):
        out[key] = _ms(value)
    return out


def latency_percentiles(log_file: Path) -> dict[str, float]:
    """p50/p90/p99 from h2load's per-request log (start us, status, duration us)."""
    durations = sorted(
        int(parts[2]) / 1000
        for parts in (line.split("\t") for line in log_file.read_text().splitlines())
        if len(parts) >= 3 and parts[1] == "200"
    )
    if not durations:
        return {}
    return {
        f"p{round(q * 100)}_ms": durations[min(len(durations) - 1, int(q * len(durations)))]
        for q in (0.5, 0.9, 0.99)
    }


class Probe(Protocol):
    """Something measured over the main window of an h2load run (after its warm-up)."""

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def report(self, requests_per_s: float) -> dict[str, Any]: ...


def run(
    url: str,
    body: bytes,
    *,
    concurrency: int,
    duration_s: float,
    warmup_s: float,
    max_connections: int,
    work_dir: Path,
    watch: Mapping[str, int] | None = None,
    probes: Sequence[Probe] = (),
) -> dict[str, Any]:
    """One timed h2load run; `watch`ed processes (and h2load itself) get CPU per request.

    Probes start once h2load's warm-up is over and stop just before its main phase ends; their
    reports use h2load's request rate, so CPU is divided by requests of the same window.
    """
    connections, streams = split_concurrency(concurrency, max_connections)
    work_dir.mkdir(parents=True, exist_ok=True)
    body_file = work_dir / "request.bin"
    body_file.write_bytes(body)
    log_file = work_dir / f"h2load-c{concurrency}-{time.monotonic_ns()}.log"
    command = [
        H2LOAD,
        f"--clients={connections}",
        f"--max-concurrent-streams={streams}",
        f"--duration={round(duration_s * 1000)}ms",
        f"--warm-up-time={round(warmup_s * 1000)}ms",
        f"--data={body_file}",
        f"--log-file={log_file}",
        "--header=content-type: application/grpc",
        "--header=te: trailers",
        url,
    ]
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    cpu = ProcessCpu({**(watch or {}), "h2load": process.pid})
    window = [cpu, *probes]
    try:
        time.sleep(max(0.0, started + warmup_s + MARGIN_S - time.perf_counter()))
        for probe in window:
            probe.start()
        time.sleep(max(0.0, started + warmup_s + duration_s - MARGIN_S - time.perf_counter()))
        for probe in window:
            probe.stop()
        output, _ = process.communicate(timeout=duration_s + warmup_s + 60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    if process.returncode:
        raise RuntimeError(f"h2load exited with {process.returncode}:\n{output}")
    result: dict[str, Any] = {
        "concurrency": concurrency,
        "connections": connections,
        "streams_per_connection": streams,
        "duration_s": duration_s,
        **parse_output(output),
        **latency_percentiles(log_file),
    }
    log_file.unlink()  # a line per request: tens of MB over a full run
    result.update(cpu.report(result["requests_per_s"]))
    result["probes"] = [probe.report(result["requests_per_s"]) for probe in probes]
    result["command"] = " ".join(command)
    return result
