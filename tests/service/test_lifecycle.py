"""Process lifecycle of the real server: readiness while loading, and draining on signals.

Every test starts its own server process on a free loopback port. Loops are bounded both in
iterations and in wall-clock time, so a misbehaving server fails a test instead of hanging it.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pooling_client import PoolingClient
from pooling_client.v1 import pooling_pb2 as pb
from pooling_client.v1 import pooling_pb2_grpc
from tests.conftest import DEFAULT_MODEL
from tests.fixture_models import MINILM
from tests.rpc_errors import decode_rpc_error
from tests.server_process import ServerProcess, free_port, start_server
from tests.service.embed_tally import EmbedTally

SERVICE = "pooling.v1.PoolingService"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

DRAIN_DELAY_S = 1.5
UNARY_WORKERS = 3
STREAM_INTERVAL_S = 0.02
# The clients must have stopped well inside the drain delay, or the test itself would be
# racing the listener closing (grpcio cancels calls that arrive as the server stops).
CLIENT_STOP_BUDGET_S = 1.0


def embed_request(request_id: str, text: str) -> pb.PoolRequest:
    return pb.PoolRequest(request_id=request_id, embed=pb.TextInput(texts=[text]))


def check_health(address: str, service: str = SERVICE, timeout: float = 1.0) -> int:
    """One Check over a fresh connection: it succeeds only while the listener accepts."""
    with grpc.insecure_channel(address) as channel:
        request = health_pb2.HealthCheckRequest(service=service)
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=timeout).status


def wait_exit(process: subprocess.Popen[bytes], timeout: float) -> int | None:
    try:
        return process.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


@dataclass
class HealthWatcher:
    """What a health-checking load balancer does: Watch, and pull out on NOT_SERVING."""

    address: str
    draining: threading.Event = field(default_factory=threading.Event)
    statuses: list[int] = field(default_factory=list)
    draining_at: float | None = None
    # New Checks ("" and the service), over a new connection, right after NOT_SERVING arrived.
    check_after: tuple[int, int] | str | None = None
    error: str | None = None

    def run(self) -> None:
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            call = stub.Watch(health_pb2.HealthCheckRequest(service=SERVICE), timeout=60)
            try:
                for response in call:
                    self.statuses.append(response.status)
                    if response.status == NOT_SERVING and SERVING in self.statuses:
                        self.draining_at = time.monotonic()
                        self.draining.set()
                        break
            except grpc.RpcError as error:
                self.error = f"{error.code().name}: {error.details()}"  # type: ignore[attr-defined]
            finally:
                call.cancel()  # hang up, so the watch does not hold the server's shutdown
                self.draining.set()  # never leave the load running
        try:
            self.check_after = (check_health(self.address, ""), check_health(self.address))
        except grpc.RpcError as error:
            self.check_after = error.code().name  # type: ignore[attr-defined]


@dataclass
class UnaryLoad(EmbedTally):
    """Unary embed calls in a loop until the watcher reports NOT_SERVING."""

    address: str
    draining: threading.Event
    last_issue_at: float = 0.0

    def run(self, worker: int, max_calls: int = 2000, max_s: float = 40.0) -> None:
        # Retries are off so that any failure the server causes is seen, not papered over.
        options = [("grpc.enable_retries", 0)]
        deadline = time.monotonic() + max_s
        with PoolingClient(self.address, timeout=30, options=options) as client:
            for i in range(max_calls):
                if self.draining.is_set() or time.monotonic() > deadline:
                    return
                with self.lock:
                    self.last_issue_at = time.monotonic()
                self.embed(client, f"worker {worker} call {i}")


@dataclass
class StreamLoad:
    """One open PoolStream, one request every 20 ms, half-closed on NOT_SERVING."""

    address: str
    draining: threading.Event
    sent: list[str] = field(default_factory=list)
    answered: dict[str, str] = field(default_factory=dict)  # request_id -> "ok" or the error
    error: str | None = None
    closed_at: float | None = None
    outbox: queue.SimpleQueue[pb.PoolStreamRequest | None] = field(
        default_factory=queue.SimpleQueue
    )

    def send(self, max_requests: int = 2000, max_s: float = 40.0) -> None:
        deadline = time.monotonic() + max_s
        try:
            for i in range(max_requests):
                if self.draining.is_set() or time.monotonic() > deadline:
                    break
                request_id = f"s{i}"
                self.sent.append(request_id)
                self.outbox.put(pb.PoolStreamRequest(request=embed_request(request_id, f"t {i}")))
                self.draining.wait(STREAM_INTERVAL_S)
        finally:
            self.closed_at = time.monotonic()
            self.outbox.put(None)  # ends the request iterator: the client half-closes

    def receive(self) -> None:
        with grpc.insecure_channel(self.address) as channel:
            stub = pooling_pb2_grpc.PoolingServiceStub(channel)
            call = stub.PoolStream(iter(self.outbox.get, None), timeout=60)
            try:
                for response in call:
                    kind = response.WhichOneof("result")
                    self.answered[response.request_id] = (
                        "ok" if kind == "response" else f"{kind}: {response.error}"
                    )
            except grpc.RpcError as error:
                self.error = f"{error.code().name}: {error.details()}"  # type: ignore[attr-defined]
            finally:
                self.outbox.put(None)  # release gRPC's request thread if it still waits


def wait_for(predicate, timeout: float, interval: float = 0.05) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def assert_refused_after_exit(address: str) -> None:
    with grpc.insecure_channel(address) as channel:
        stub = pooling_pb2_grpc.PoolingServiceStub(channel)
        with pytest.raises(grpc.RpcError) as failed:
            stub.Pool(embed_request("after-exit", "hello"), timeout=5)
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]


def test_sigterm_drains_under_load(tmp_path: Path) -> None:
    server = start_server(
        ["--drain-delay-s", str(DRAIN_DELAY_S), "--shutdown-grace-s", "20"], tmp_path, "drain"
    )
    threads: list[threading.Thread] = []
    try:
        watcher = HealthWatcher(server.address)
        unary = UnaryLoad(server.address, watcher.draining)
        stream = StreamLoad(server.address, watcher.draining)
        threads = [
            threading.Thread(target=watcher.run, daemon=True),
            threading.Thread(target=stream.receive, daemon=True),
            threading.Thread(target=stream.send, daemon=True),
            *(
                threading.Thread(target=unary.run, args=(w,), daemon=True)
                for w in range(UNARY_WORKERS)
            ),
        ]
        for thread in threads:
            thread.start()
        assert wait_for(lambda: SERVING in watcher.statuses, 10), watcher
        assert wait_for(lambda: unary.ok >= 60 and len(stream.answered) >= 25, 30), (
            unary.ok,
            len(stream.answered),
            unary.errors[:5],
            stream.error,
        )

        sigterm_at = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        assert watcher.draining.wait(5), "the watcher never saw NOT_SERVING"
        for thread in threads:
            thread.join(30)
        assert not any(thread.is_alive() for thread in threads)
        returncode = wait_exit(server.process, 30)
        exited_at = time.monotonic()
        log = server.log()

        # Health went NOT_SERVING first, while the listener still took new connections.
        assert watcher.error is None, watcher.error
        assert watcher.statuses[-1] == NOT_SERVING and watcher.draining_at is not None
        assert watcher.check_after == (NOT_SERVING, NOT_SERVING), watcher.check_after
        # The test's premise: everybody pulled out well inside the drain delay.
        assert unary.last_issue_at - sigterm_at < CLIENT_STOP_BUDGET_S
        assert stream.closed_at is not None and stream.closed_at - sigterm_at < (
            CLIENT_STOP_BUDGET_S
        )

        # Nothing accepted was lost.
        assert unary.errors == [], unary.errors[:10]
        assert unary.ok >= 60
        assert stream.error is None, stream.error
        assert len(stream.sent) >= 25
        assert set(stream.answered) == set(stream.sent), sorted(
            set(stream.sent) ^ set(stream.answered)
        )
        assert all(result == "ok" for result in stream.answered.values()), [
            result for result in stream.answered.values() if result != "ok"
        ][:5]

        # A clean exit, after the drain delay but without using up the grace period.
        assert returncode == 0, log
        assert DRAIN_DELAY_S <= exited_at - sigterm_at < 15, exited_at - sigterm_at
        assert "shutting down" in log and "stopped" in log
        assert "(uvloop event loop)" in log  # the default loop drains so
        assert_refused_after_exit(server.address)
    finally:
        server.stop(signal.SIGKILL)


def health_or_code(address: str) -> int | str:
    """A fresh-connection Check's status, or the name of the code it failed with."""
    try:
        return check_health(address)
    except grpc.RpcError as error:
        return error.code().name  # type: ignore[attr-defined]


def test_sigint_drains_like_sigterm(tmp_path: Path) -> None:
    """On asyncio's own loop: the drain above runs on uvloop, this one covers the other."""
    server = start_server(
        ["--drain-delay-s", "1", "--shutdown-grace-s", "20", "--event-loop", "asyncio"],
        tmp_path,
        "sigint",
    )
    outbox: queue.SimpleQueue[pb.PoolStreamRequest | None] = queue.SimpleQueue()

    def stream_request(request_id: str) -> pb.PoolStreamRequest:
        return pb.PoolStreamRequest(request=embed_request(request_id, f"text {request_id}"))

    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pooling_pb2_grpc.PoolingServiceStub(channel)
            assert len(stub.Pool(embed_request("u", "before"), timeout=30).embed.embeddings) == 1
            call = stub.PoolStream(iter(outbox.get, None), timeout=60)
            outbox.put(stream_request("s0"))
            assert next(call).request_id == "s0"

            server.process.send_signal(signal.SIGINT)
            # NOT_SERVING during the drain delay, while new connections are still taken...
            assert wait_for(lambda: health_or_code(server.address) == NOT_SERVING, 0.9)
            # ...then the listener closes.
            assert wait_for(lambda: health_or_code(server.address) == "UNAVAILABLE", 10)
            assert server.process.poll() is None  # still finishing the open stream
            # The stream was accepted before the stop, so it keeps working until it ends.
            outbox.put(stream_request("s1"))
            outbox.put(stream_request("s2"))
            outbox.put(None)
            rest = list(call)
            assert sorted(r.request_id for r in rest) == ["s1", "s2"]
            assert all(r.WhichOneof("result") == "response" for r in rest), rest
            assert call.code() == grpc.StatusCode.OK  # type: ignore[attr-defined]
        assert wait_exit(server.process, 30) == 0, server.log()
        assert "Traceback" not in server.log()
        assert "(asyncio event loop)" in server.log()
        assert_refused_after_exit(server.address)
    finally:
        outbox.put(None)
        server.stop(signal.SIGKILL)


# An open health Watch must not hold the exit for the whole --shutdown-grace-s: the
# server ends Watch streams once the drain delay is over.
def test_open_health_watch_does_not_hold_shutdown(tmp_path: Path) -> None:
    server = start_server(["--drain-delay-s", "0.2", "--shutdown-grace-s", "6"], tmp_path, "watch")
    seen: list[int | str] = []
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            call = stub.Watch(health_pb2.HealthCheckRequest(service=SERVICE), timeout=30)

            def watch() -> None:
                try:
                    seen.extend(response.status for response in call)
                    seen.append("ended OK")
                except grpc.RpcError as error:
                    seen.append(error.code().name)  # type: ignore[attr-defined]

            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
            assert wait_for(lambda: SERVING in seen, 5), seen
            sigterm_at = time.monotonic()
            server.process.send_signal(signal.SIGTERM)
            returncode = wait_exit(server.process, 30)
            elapsed = time.monotonic() - sigterm_at
            watcher.join(5)
            call.cancel()
        assert returncode == 0, server.log()
        assert NOT_SERVING in seen, seen
        assert elapsed < 4.5, f"exit took {elapsed:.1f}s after SIGTERM; the watch saw {seen}"
    finally:
        server.stop(signal.SIGKILL)


@dataclass
class Probe:
    """One health Check: a status, or the gRPC code it failed with."""

    at: float
    status: int | None
    code: grpc.StatusCode | None


def test_not_serving_while_models_load(tmp_path: Path) -> None:
    # Four models (the embedded MiniLM under different names) make loading take seconds.
    models = [f"a={DEFAULT_MODEL}", f"b={MINILM}", f"c={MINILM}", f"d={MINILM}"]
    port = free_port()
    address = f"127.0.0.1:{port}"
    log_path = tmp_path / f"loading-{port}.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    args = [
        sys.executable,
        "-m",
        "pooling_server.service.launch",
        "--port",
        str(port),
        "--device",
        "cpu",
    ]
    for model in models:
        args += ["--model", model]
    with log_path.open("wb") as log:
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = ServerProcess(process, port, log_path)
    probes: list[Probe] = []
    not_ready: grpc.RpcError | None = None
    try:
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            pooling = pooling_pb2_grpc.PoolingServiceStub(channel)
            request = health_pb2.HealthCheckRequest(service=SERVICE)
            deadline = time.monotonic() + 120
            for _ in range(20_000):
                if time.monotonic() > deadline or process.poll() is not None:
                    break
                try:
                    status = health.Check(request, timeout=1).status
                    probes.append(Probe(time.monotonic(), status, None))
                except grpc.RpcError as error:
                    code = error.code()  # type: ignore[attr-defined]
                    probes.append(Probe(time.monotonic(), None, code))
                    time.sleep(0.02)
                    continue
                if status == SERVING:
                    break
                if status == NOT_SERVING and not_ready is None:
                    try:
                        pooling.Pool(embed_request("early", "too soon"), timeout=5)
                    except grpc.RpcError as error:
                        not_ready = error
                    else:
                        pytest.fail("a Pool call made while NOT_SERVING succeeded")
                time.sleep(0.02)
        statuses = [p.status for p in probes if p.status is not None]
        codes = {p.code for p in probes if p.code is not None}
        assert statuses and statuses[-1] == SERVING, (statuses[-5:], codes, server.log())
        assert NOT_SERVING in statuses, statuses
        # Once up, health never answered anything but NOT_SERVING and then SERVING.
        first_serving = statuses.index(SERVING)
        assert set(statuses[:first_serving]) == {NOT_SERVING}
        # Before the listener was up, a probe can only have been refused.
        assert codes <= {grpc.StatusCode.UNAVAILABLE}, codes
        assert not_ready is not None
        decoded = decode_rpc_error(not_ready)
        assert decoded.code == grpc.StatusCode.UNAVAILABLE
        assert decoded.reason == "NOT_READY"
        assert decoded.retry is not None and decoded.retry.retry_delay.ToNanoseconds() > 0
        # And now it serves every model.
        with PoolingClient(address, timeout=30) as client:
            assert [m.name for m in client.models()] == ["a", "b", "c", "d"]
            assert len(client.embed(["ready"], model="d")[0].outputs.embedding) == 384
        assert server.stop(signal.SIGTERM) == 0, server.log()
    finally:
        server.stop(signal.SIGKILL)
