"""Drain under load, whoever gets the signal: no call the server started may be lost.

systemd's default `KillMode=control-group`, `timeout` and `tini -g` signal the whole
process group, not just the supervisor; Ctrl-C in a terminal does the same with SIGINT;
some tools signal every process of the tree one by one. Each case starts a real split
server (the default: a supervisor, one engine process, one front end) with the tiny model
in a session of its own, runs 24 clients calling Pool in a loop, sends SIGTERM or SIGINT
to the supervisor, the group or every process (or SIGTERM to the engine alone, which must
change nothing, then to the front end alone), and checks that every failed call is one the
server never started: refused with UNAVAILABLE, or CANCELLED by grpcio before any handler
took it, and absent from the server's request log. None may fail with ENGINE_DEAD or any
other error after a handler took it, and the server must exit 0. The single-process server
(`--frontends 0`) gets the group signal too. Each case prints one
`RELIABILITY drain_<signal>_<target>:` line."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import socket
import subprocess
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import psutil
import pytest

from pooling_client.v1 import pooling_pb2 as pb
from pooling_client.v1 import pooling_pb2_grpc
from tests.reliability.support import embed_request, report
from tests.rpc_errors import decode_rpc_error
from tests.server_process import ServerProcess, free_port, process_tree, start_server

CLIENTS = 24
WARM_CALLS = 48  # successes before the signal: the clients are all under way
CALL_TIMEOUT_S = 20.0
EXIT_TIMEOUT_S = 30.0
TRICKLE_CHUNK = 32 * 1024
# How a call the server never started may fail: refused by a closed listener (UNAVAILABLE),
# refused by a draining handler (UNAVAILABLE / NOT_READY), or, when it was still waiting in
# grpcio's core for a handler as the server shut down, CANCELLED (grpc/grpc#41785: the core
# cancels calls no handler has taken yet). Which ones were started is read from the
# server's request log (--log-requests), which records every call a handler took, on
# success, on failure and on cancellation.
UNSTARTED_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})
REQUEST_LINE = re.compile(r'request_id="([^"]*)".*? code="([^"]*)"')


@dataclass
class Failure:
    request_id: str
    code: grpc.StatusCode
    reason: str
    message: str

    def __str__(self) -> str:
        return f"{self.request_id}: {self.code.name} {self.reason or '-'}: {self.message[:120]}"


@dataclass
class PoolLoad:
    """CLIENTS threads, each on a connection of its own, calling Pool until told to stop."""

    address: str
    ok: int = 0
    failures: list[Failure] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for k in range(CLIENTS):
            thread = threading.Thread(target=self._run, args=(k,), name=f"client {k}", daemon=True)
            thread.start()
            self.threads.append(thread)

    def _run(self, k: int) -> None:
        # Retries off, so that a failure the server causes is seen, not papered over.
        options = [("grpc.use_local_subchannel_pool", 1), ("grpc.enable_retries", 0)]
        with grpc.insecure_channel(self.address, options=options) as channel:
            stub = pooling_pb2_grpc.PoolingServiceStub(channel)
            n = 0
            while not self.stop.is_set():
                n += 1
                request_id = f"c{k}-{n}"
                text = f"client {k} call {n}: a short sentence to pool"
                try:
                    stub.Pool(embed_request([text], request_id=request_id), timeout=CALL_TIMEOUT_S)
                except grpc.RpcError as error:
                    decoded = decode_rpc_error(error)
                    failure = Failure(
                        request_id, decoded.code, decoded.reason or "", decoded.message
                    )
                    with self.lock:
                        self.failures.append(failure)
                    self.stop.wait(0.1)  # a closed listener refuses at once: do not spin
                else:
                    with self.lock:
                        self.ok += 1

    def wait_ok(self, count: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if self.ok >= count or self.failures:
                    return self.ok >= count
            time.sleep(0.02)
        return False

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(CALL_TIMEOUT_S + 5)


def started_calls(log: str) -> dict[str, str]:
    """request_id -> code, for every call a handler of the server took."""
    return {m.group(1): m.group(2) for m in REQUEST_LINE.finditer(log)}


def lost_calls(failures: list[Failure], started: dict[str, str]) -> list[str]:
    """Failures of calls the server started, and failures no refusal explains."""
    lost = []
    for failure in failures:
        if failure.request_id in started:
            lost.append(f"{failure} (started: logged {started[failure.request_id]})")
        elif failure.code not in UNSTARTED_CODES or failure.reason not in ("", "NOT_READY"):
            lost.append(str(failure))
    return lost


def role(tree: list[psutil.Process], name: str) -> psutil.Process:
    [process] = [p for p in tree if f"--role {name}" in " ".join(p.cmdline())]
    return process


def send(server: ServerProcess, sig: signal.Signals, target: str, load: PoolLoad) -> int:
    """Signal `target`; returns how many processes the server had."""
    tree = process_tree(server.process.pid)
    if target == "supervisor":
        os.kill(server.process.pid, sig)
    elif target == "group":
        os.killpg(server.process.pid, sig)  # the server leads its own session
    elif target == "every process":  # children first, as `kill` of every pid does
        for process in reversed(tree):
            process.send_signal(sig)
    else:  # "engine, then front end": the engine alone ignores it; the front end drains
        role(tree, "engine").send_signal(sig)
        ok = load.ok
        assert load.wait_ok(ok + CLIENTS, 10), "calls stopped after the engine got the signal"
        assert not load.failures, [str(f) for f in load.failures[:5]]
        role(tree, "frontend").send_signal(sig)
    return len(tree)


@pytest.fixture(scope="module")
def model_args(model_folders: dict[str, Path]) -> list[str]:
    return ["--model", f"tiny-bert={model_folders['tiny-bert']}", "--dtype", "float32"]


def drain_case(
    model_args: list[str],
    log_dir: Path,
    record_property,  # type: ignore[no-untyped-def]
    sig: signal.Signals,
    target: str,
    frontends: int = 1,
) -> None:
    name = f"drain_{sig.name.lower()}_" + re.sub(r"\W+", "_", target)
    name += "_single_process" if frontends == 0 else ""
    args = [*model_args, "--device", "cpu", "--frontends", str(frontends)]
    args += ["--shutdown-grace-s", "20", "--log-requests"]
    server = start_server(args, log_dir, name, new_session=True)
    load = PoolLoad(server.address)
    try:
        load.start()
        assert load.wait_ok(WARM_CALLS, 30), (load.ok, [str(f) for f in load.failures[:5]])
        ok_before = load.ok
        signalled_at = time.monotonic()
        processes = send(server, sig, target, load)
        try:
            returncode: int | None = server.process.wait(EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:  # a server that hangs fails below, with its log
            returncode = None
        exit_s = time.monotonic() - signalled_at
        load.finish()
        log = server.log()
        started = started_calls(log)
        lost = lost_calls(load.failures, started)
        codes = Counter(f.code.name for f in load.failures if f.request_id not in started)
        report(
            record_property,
            name,
            processes=processes,
            clients=CLIENTS,
            ok_before=ok_before,
            ok=load.ok,
            refused_unavailable=codes["UNAVAILABLE"],
            cancelled_unstarted=codes["CANCELLED"],
            lost=len(lost),
            exit_code=returncode,
            exit_s=exit_s,
        )
        assert lost == [], lost[:10]
        assert load.ok > ok_before, "no call finished during the drain"
        # Every success was a call the server logged: the log is a complete account.
        assert sum(code == "OK" for code in started.values()) == load.ok
        assert returncode == 0, log[-4000:]
        assert "Traceback" not in log, log[-4000:]
        if target.startswith("engine"):
            assert "drained on a signal of its own" in log, log[-4000:]
    finally:
        load.finish()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.process.pid, signal.SIGKILL)  # leave no child behind
        server.process.wait()


@pytest.mark.parametrize("target", ["supervisor", "group", "every process"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_split_server_drains_whoever_gets_the_signal(
    model_args: list[str],
    tmp_path: Path,
    record_property,  # type: ignore[no-untyped-def]
    sig: signal.Signals,
    target: str,
) -> None:
    drain_case(model_args, tmp_path, record_property, sig, target)


def test_single_process_server_drains_on_a_group_signal(
    model_args: list[str],
    tmp_path: Path,
    record_property,  # type: ignore[no-untyped-def]
) -> None:
    drain_case(model_args, tmp_path, record_property, signal.SIGTERM, "group", frontends=0)


def test_split_server_drains_when_only_its_front_end_gets_the_signal(
    model_args: list[str],
    tmp_path: Path,
    record_property,  # type: ignore[no-untyped-def]
) -> None:
    """The engine ignores a SIGTERM of its own; the front end's starts the whole drain."""
    drain_case(model_args, tmp_path, record_property, signal.SIGTERM, "engine, then front end")


def _trickle(port: int, sent: threading.Event, stop: threading.Event) -> None:
    """An embed body of ~1 MB of JSON whitespace at 64 KiB/s, above the door's minimum rate:
    its request runs for about 16 s unless the server cuts it."""
    head = b'{"input": "held open past the grace"'
    with socket.create_connection(("127.0.0.1", port), timeout=EXIT_TIMEOUT_S) as sock:
        sock.sendall(
            b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(head) + 32 * TRICKLE_CHUNK + 1}\r\n\r\n".encode()
            + head
        )
        with contextlib.suppress(OSError):  # the server cuts it: the point of the test
            for _ in range(32):
                sock.sendall(b" " * TRICKLE_CHUNK)
                sent.set()
                if stop.wait(0.5):
                    return
            sock.sendall(b"}")


def test_exit_code_is_1_when_the_grace_runs_out(
    model_args: list[str],
    tmp_path: Path,
    record_property,  # type: ignore[no-untyped-def]
) -> None:
    """A stream and an HTTP request still running when --shutdown-grace-s runs out are cut
    (grpcio cancels the one, the HTTP door the other): that is a loss, so the front end
    exits 1 and so does the supervisor, and the log names both."""
    http_port = free_port()
    args = [*model_args, "--device", "cpu", "--shutdown-grace-s", "1"]
    args += ["--http-port", str(http_port)]
    server = start_server(args, tmp_path, "drain_grace", new_session=True)
    outbox: queue.SimpleQueue[pb.PoolStreamRequest | None] = queue.SimpleQueue()
    sent, stop = threading.Event(), threading.Event()
    trickle = threading.Thread(target=_trickle, args=(http_port, sent, stop), daemon=True)
    try:
        with grpc.insecure_channel(server.address) as channel:
            call = pooling_pb2_grpc.PoolingServiceStub(channel).PoolStream(
                iter(outbox.get, None), timeout=EXIT_TIMEOUT_S
            )
            request = embed_request(["held open past the grace"], request_id="s0")
            outbox.put(pb.PoolStreamRequest(request=request))
            assert next(call).request_id == "s0"
            trickle.start()
            assert sent.wait(10)
            time.sleep(0.3)  # the body's first bytes are in: its request runs
            signalled_at = time.monotonic()
            os.killpg(server.process.pid, signal.SIGTERM)
            returncode = server.process.wait(EXIT_TIMEOUT_S)
            exit_s = time.monotonic() - signalled_at
            with pytest.raises(grpc.RpcError) as ended:
                next(call)
        code = ended.value.code()  # type: ignore[attr-defined]
        report(
            record_property,
            "drain_grace_ran_out",
            stream_code=code.name,
            exit_code=returncode,
            exit_s=exit_s,
        )
        log = server.log()
        assert returncode == 1, log[-3000:]
        assert "--shutdown-grace-s 1 ran out: calls still running were cancelled" in log
        assert "--shutdown-grace-s 1 ran out: HTTP requests still running were cut" in log
        assert exit_s < 10
    finally:
        stop.set()
        outbox.put(None)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.process.pid, signal.SIGKILL)
        server.process.wait()
