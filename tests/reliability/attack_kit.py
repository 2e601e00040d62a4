"""What every attack test watches: a bystander client, the server tree's peak RSS, timing.

While an attack runs, a bystander on its own connection makes one short Pool call every
100 ms and a sampler reads the resident memory of every server process every 10 ms.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import grpc
import psutil

from pooling_client.v1 import pooling_pb2_grpc
from tests.reliability.support import check_rpc_error, embed_request
from tests.rpc_errors import DecodedError
from tests.server_process import ServerProcess, process_tree

MB = 1 << 20
RSS_LIMIT_MB = 100
BYSTANDER_LIMIT_S = 1.5  # the slowest bystander call an attack may cause (issue 43's bound)
BYSTANDER_TIMEOUT_S = 5.0  # a bystander call slower than this counts as a failure
PROBE_TIMEOUT_S = 2.0  # an idle server answers a short call well within this
ANSWER_TIMEOUT_S = 3.0  # how long an attack call may take before it counts as unanswered
INVALID = [grpc.StatusCode.INVALID_ARGUMENT]


class Bystander:
    """One short unary Pool call every 100 ms on a connection of its own."""

    def __init__(self, address: str, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        # A local subchannel pool: never a connection shared with the test's channels.
        self.channel = grpc.insecure_channel(
            address, options=[("grpc.use_local_subchannel_pool", 1)]
        )
        self.stub = pooling_pb2_grpc.PoolingServiceStub(self.channel)
        self.metadata = metadata
        self.latencies: list[float] = []
        self.failures: Counter[str] = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bystander", daemon=True)

    def _call(self, timeout: float) -> None:
        self.stub.Pool(embed_request(["a bystander"]), timeout=timeout, metadata=self.metadata)

    def start(self) -> None:
        """Connect, and check the server answers at once before the attack starts."""
        grpc.channel_ready_future(self.channel).result(timeout=10)
        try:
            self._call(timeout=PROBE_TIMEOUT_S)
        except grpc.RpcError as error:
            self.channel.close()
            raise AssertionError(
                f"before the attack, a short call got {error.code().name} within "  # type: ignore[attr-defined]
                f"{PROBE_TIMEOUT_S}s: the server is still busy with an earlier one"
            ) from error
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self._call(BYSTANDER_TIMEOUT_S)
            except grpc.RpcError as error:
                self.failures[error.code().name] += 1  # type: ignore[attr-defined]
            self.latencies.append(time.monotonic() - started)
            self._stop.wait(max(0.0, started + 0.1 - time.monotonic()))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(BYSTANDER_TIMEOUT_S + 5)
        self.channel.close()


class PeakRss:
    """The server's resident memory, sampled every 10 ms: the peak above the first sample.

    The server by default is a supervisor with front-end and engine processes under it, so
    this is the sum over the process and every descendant it has when the sampling starts.
    """

    def __init__(self, pid: int) -> None:
        self.processes = [p for p in process_tree(pid) if self._counted(p)]
        self.first = self._sizes()
        self.baseline = self.peak = sum(self.first)
        self.at_peak = self.first  # each process's size when the total peaked
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss", daemon=True)
        self._thread.start()

    def _counted(self, process: psutil.Process) -> bool:
        return True

    def _sizes(self) -> list[int]:
        return [process.memory_info().rss for process in self.processes]

    def _total(self) -> int:
        return sum(self._sizes())

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            try:
                sizes = self._sizes()
            except psutil.Error:  # a server process died: the test says so
                return
            if sum(sizes) > self.peak:
                self.peak, self.at_peak = sum(sizes), sizes

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    @property
    def extra_mb(self) -> float:
        return (self.peak - self.baseline) / MB

    @property
    def growth_at_peak(self) -> str:
        """Which process grew by how much at the peak: pid and name, MB."""
        return ",".join(
            f"{process.pid}:{_name(process)}+{(size - first) / MB:.0f}"
            for process, size, first in zip(self.processes, self.at_peak, self.first, strict=True)
        )


def _name(process: psutil.Process) -> str:
    try:
        return process.name()
    except psutil.Error:
        return "gone"


@dataclass
class Watch:
    bystander: Bystander
    rss: PeakRss
    answer_s: float = 0.0  # the attack's time to answer, set by the test

    def figures(self) -> dict[str, object]:
        latencies = self.bystander.latencies
        return {
            "answer_s": self.answer_s,
            "extra_rss_mb": self.rss.extra_mb,
            "growth_at_peak_mb": self.rss.growth_at_peak,
            "bystander_calls": len(latencies),
            "bystander_max_s": max(latencies, default=0.0),
            "bystander_failures": dict(self.bystander.failures),
        }

    def assert_unharmed(self) -> None:
        assert not self.bystander.failures, f"bystander failures: {dict(self.bystander.failures)}"
        slowest = max(self.bystander.latencies, default=0.0)
        assert slowest < BYSTANDER_LIMIT_S, f"a bystander call took {slowest:.2f}s"
        assert self.rss.extra_mb < RSS_LIMIT_MB, f"server RSS grew {self.rss.extra_mb:.0f} MB"


@contextmanager
def watching(server: ServerProcess, metadata: tuple[tuple[str, str], ...] = ()) -> Iterator[Watch]:
    bystander = Bystander(server.address, metadata)
    bystander.start()
    rss = PeakRss(server.process.pid)
    try:
        yield Watch(bystander, rss)
    finally:
        time.sleep(0.2)  # a last bystander call or two after the attack
        rss.stop()
        bystander.stop()


def timed(call: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[float, Any]:
    """(seconds, the result or the grpc.RpcError raised)."""
    started = time.monotonic()
    try:
        result = call(*args, **kwargs)
    except grpc.RpcError as error:
        result = error
    return time.monotonic() - started, result


def refusal(result: Any, allowed: list[grpc.StatusCode] = INVALID) -> DecodedError:
    assert isinstance(result, grpc.RpcError), f"expected an error, got {type(result).__name__}"
    return check_rpc_error(result, allowed)
