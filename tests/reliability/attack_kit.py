"""What every attack test watches: a bystander client, the server tree's peak RSS, timing.

While an attack runs, a bystander on its own connection makes one short Pool call every
100 ms and a sampler reads the resident memory of every server process every 10 ms. Once
the attacker has gone, a Verdict measures what the attack left (the server still busy,
memory still held) and checks every figure together.

Every time an attack is held to (the bystander's slowest call, a refusal's) is a Bound of
two figures, so that no test sits at its edge (issue 45):
- `target_s`, what the issues ask: it is reported (`Watch.figures`, a RELIABILITY line), and
  a figure over it warns (OverTarget, in pytest's warnings summary) without failing;
- `limit_s`, what fails the test: twice the target. On the shared 2-core host a bystander's
  short call has taken 0.7-1.5 s beside no attack at all (docs/reliability.md), and 1.01 s
  against a 1 s bound beside one; what an attack does when it reaches the bystander (an
  engine held for seconds, a queue behind a flood, a timeout) lands well past twice.
"""

from __future__ import annotations

import functools
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc
import psutil

from pooling_client.v1 import pooling_pb2 as pb
from pooling_client.v1 import pooling_pb2_grpc
from tests.reliability.support import assert_alive, check_rpc_error, embed_request, report
from tests.rpc_errors import DecodedError
from tests.server_process import ServerProcess, process_tree

MB = 1 << 20
RSS_LIMIT_MB = 100


class OverTarget(UserWarning):
    """A time over its target and within its limit: reported, not failed."""


@dataclass(frozen=True)
class Bound:
    """A time an attack is held to: its target (reported) and its limit (failed), see above."""

    target_s: float
    limit_s: float

    def problem(self, seconds: float, what: str) -> str | None:
        """None within the limit (with an OverTarget warning past the target), else what
        went wrong, naming both figures."""
        if seconds >= self.limit_s:
            return (
                f"{what} took {seconds:.2f}s (target {self.target_s:g} s, limit {self.limit_s:g} s)"
            )
        if seconds >= self.target_s:
            warnings.warn(
                OverTarget(f"{what} took {seconds:.2f}s, over its {self.target_s:g} s target"),
                stacklevel=3,
            )
        return None

    def check(self, seconds: float, what: str) -> None:
        problem = self.problem(seconds, what)
        assert problem is None, problem


# The slowest bystander call an attack may cause: issue 43's 1.5 s.
BYSTANDER = Bound(target_s=1.5, limit_s=3.0)
# The same for the gRPC door's and the image attacks, whose issues asked 1 s.
QUICK_BYSTANDER = Bound(target_s=1.0, limit_s=2.0)
# An attack's refusal, from the call (or the attack's last byte) to its answer.
REFUSAL = Bound(target_s=1.0, limit_s=2.0)
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
    bound: Bound = BYSTANDER  # the bystander's

    @property
    def slowest_s(self) -> float:
        return max(self.bystander.latencies, default=0.0)

    def figures(self) -> dict[str, object]:
        return {
            "answer_s": self.answer_s,
            "extra_rss_mb": self.rss.extra_mb,
            "growth_at_peak_mb": self.rss.growth_at_peak,
            "bystander_calls": len(self.bystander.latencies),
            "bystander_max_s": self.slowest_s,
            "bystander_target_s": self.bound.target_s,
            "bystander_failures": dict(self.bystander.failures),
        }

    def assert_unharmed(self) -> None:
        assert not self.bystander.failures, f"bystander failures: {dict(self.bystander.failures)}"
        self.bound.check(self.slowest_s, "a bystander call")
        assert self.rss.extra_mb < RSS_LIMIT_MB, f"server RSS grew {self.rss.extra_mb:.0f} MB"


@contextmanager
def watching(
    server: ServerProcess,
    metadata: tuple[tuple[str, str], ...] = (),
    sampled: type[PeakRss] = PeakRss,
    bound: Bound = BYSTANDER,
) -> Iterator[Watch]:
    """A bystander (held to `bound`) and an RSS sampler (`sampled`: which processes count)
    around an attack."""
    bystander = Bystander(server.address, metadata)
    bystander.start()
    rss = sampled(server.process.pid)
    try:
        yield Watch(bystander, rss, bound=bound)
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


# --------------------------------------------------------------------------- after a door attack

PEAK_LIMIT_MB = 300  # growth while an attack on a door runs
SETTLED_LIMIT_MB = 100  # growth once the attacker has gone
SETTLE_S = 10.0  # how long the server has to give memory back after the attacker leaves
IDLE_S = 30.0  # how long the server may stay busy with an attack's work once it has gone


@functools.lru_cache(maxsize=64)
def _is_engine(pid: int) -> bool:
    try:
        return "engine" in psutil.Process(pid).cmdline()
    except psutil.Error:
        return False


class DoorRss(PeakRss):
    """PeakRss over every server process but the engines: the supervisor, the front end
    that holds the door, and the door's Node.js child. An engine's forward pass keeps its
    own scratch memory whatever door fed it; what an attack on the door costs is here."""

    def _counted(self, process: psutil.Process) -> bool:
        return not _is_engine(process.pid)


def watching_door(server: ServerProcess, bound: Bound = BYSTANDER) -> AbstractContextManager[Watch]:
    """watching, with the door's processes sampled (DoorRss)."""
    return watching(server, sampled=DoorRss, bound=bound)


def door(server: ServerProcess) -> str:
    return server.grpc_door()


def node_rss_mb(server: ServerProcess) -> float:
    """The Node.js door's own resident memory (0 when grpcio serves gRPC)."""
    tree = psutil.Process(server.process.pid).children(recursive=True)
    return sum(p.memory_info().rss for p in tree if p.name() == "node") / MB


def idle_after(server: ServerProcess) -> float:
    """Seconds until a short call is answered within a second again (IDLE_S at most): the
    attack's work that outlives the attacker, and what the next test would otherwise pay."""
    started = time.monotonic()
    with grpc.insecure_channel(server.address) as channel:
        stub = pooling_pb2_grpc.PoolingServiceStub(channel)
        while time.monotonic() - started < IDLE_S:
            try:
                stub.Pool(embed_request(["idle yet?"]), timeout=1.0)
                break
            except grpc.RpcError:
                time.sleep(0.5)
    return time.monotonic() - started


def settled_mb(rss: PeakRss) -> float:
    """Growth over the baseline once the attacker has gone: polled until it is under the
    limit, or SETTLE_S has passed (memory a server keeps after that, it keeps)."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        growth = (rss._total() - rss.baseline) / MB
        if growth < SETTLED_LIMIT_MB or time.monotonic() > deadline:
            return growth
        time.sleep(0.25)


@dataclass
class Verdict:
    """What one attack did to the server: checked together, so a failure names them all.
    `settled` and `idle_s` are None where the test does not measure them."""

    attack: str
    server: ServerProcess
    watch: Watch
    record_property: Callable[[str, object], None]  # the test's, for its RELIABILITY line
    settled: float | None = None
    idle_s: float | None = None
    problems: list[str] = field(default_factory=list)

    @classmethod
    def after(
        cls,
        attack: str,
        server: ServerProcess,
        watch: Watch,
        record_property: Callable[[str, object], None],
        idle: bool = True,
    ) -> Verdict:
        """Once the attacker has gone: how long the server stays busy with its work (with
        `idle`), then what memory it keeps."""
        idle_s = idle_after(server) if idle else None
        return cls(attack, server, watch, record_property, settled_mb(watch.rss), idle_s)

    def report(self, name: str, **figures: object) -> None:
        """The attack's RELIABILITY line: the door, the attack's own figures, what it left,
        the watch's."""
        left = {"settled_mb": self.settled, "idle_s": self.idle_s}
        figures.update({key: value for key, value in left.items() if value is not None})
        report(
            self.record_property, name, door=door(self.server), **figures, **self.watch.figures()
        )

    def within(self, bound: Bound, seconds: float, what: str) -> None:
        if (problem := bound.problem(seconds, what)) is not None:
            self.problems.append(problem)

    def check(self) -> None:
        """Every figure against its limit, then the server still serving."""
        if self.idle_s is not None and self.idle_s >= IDLE_S:
            self.problems.append(f"the server was still busy {IDLE_S:.0f}s after the attacker left")
        bystander = self.watch.bystander
        if bystander.failures:
            self.problems.append(f"bystander failures {dict(bystander.failures)}")
        self.within(self.watch.bound, self.watch.slowest_s, "a bystander call")
        if self.watch.rss.extra_mb >= PEAK_LIMIT_MB:
            self.problems.append(
                f"peak growth {self.watch.rss.extra_mb:.0f} MB (limit {PEAK_LIMIT_MB} MB)"
            )
        if self.settled is not None and self.settled >= SETTLED_LIMIT_MB:
            self.problems.append(
                f"{self.settled:.0f} MB still held {SETTLE_S:.0f}s after the attacker left "
                f"(limit {SETTLED_LIMIT_MB} MB)"
            )
        assert not self.problems, f"{self.attack}: " + "; ".join(self.problems)
        assert_alive(self.server)


def wide_token_embed(texts: int) -> pb.PoolRequest:
    """token_embed of `texts` texts cut to the wide BERT's 128 tokens (fixture_models'
    wide_bert): the largest answers a text can ask for, ~200 KB each."""
    return pb.PoolRequest(
        model="wide",
        token_embed=pb.TextInput(texts=["word and more " * 50] * texts),
        params=pb.PoolingParams(truncate_prompt_tokens=-1),
    )


def warm_up(server: ServerProcess, token_embed_texts: int, tokenize: bool = False) -> None:
    """The first batches of each shape an attack will ask, so that the bystander does not
    pay for them."""
    with grpc.insecure_channel(server.address) as channel:
        stub = pooling_pb2_grpc.PoolingServiceStub(channel)
        for _ in range(5):
            stub.Pool(embed_request(["a bystander"]), timeout=60)
        stub.Pool(wide_token_embed(token_embed_texts), timeout=60)
        if tokenize:
            stub.Tokenize(pb.TokenizeRequest(texts=["warm " * 1000]), timeout=60)
