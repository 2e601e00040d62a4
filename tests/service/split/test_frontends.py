"""A split server: --frontends N front-end processes on one port over K engine processes.

Real `pooling-server` subprocesses on real ports, serving the small random-weight fixture
models. The kernel spreads connections over the front ends (SO_REUSEPORT), so each test
opens separate channels (each with its own subchannel pool, hence its own connection) until
every front end holds one (seen with psutil), rather than hoping the hash spreads them.
Engine figures (queue depth, drops, mixed batches) reach the one /metrics endpoint every
quarter second, so the tests poll it.
"""

from __future__ import annotations

import asyncio
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pooling_client.v1 import pooling_pb2 as pb
from pooling_client.v1 import pooling_pb2_grpc
from pooling_server.engine.inputs.tokenization import TokenSequence
from pooling_server.engine.scheduling.ipc import (
    Cancel,
    EngineReady,
    Link,
    Submit,
    to_engine_decoder,
)
from pooling_server.engine.scheduling.jobs import Job
from pooling_server.engine.scheduling.remote_client import RemoteEngineClient
from tests.conftest import server_args
from tests.metrics_endpoint import metric_sum, scrape
from tests.responses import assert_same_response
from tests.rpc_errors import decode_rpc_error
from tests.server_process import ServerProcess, free_port, start_server
from tests.service.mixed_requests import (
    MIXED_KINDS,
    mixed_models,
    mixed_requests,
    phrases,
    text_request,
)

Stub = pooling_pb2_grpc.PoolingServiceStub
WAIT_S = 60.0
DRAIN_DELAY_S = 1.0
CUT_MARGIN_S = 0.3  # between this process's clock and the server's end of the drain delay
BATCH_WAIT_MS = 2000  # the batching server's: items wait long enough to cancel, or to be lost
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SENTENCE = (
    "the river runs past the old mill where children play in summer and the fishermen "
    "mend their nets while clouds gather over the hills beyond the quiet town"
)

phrase = phrases(SENTENCE, most_words=25)


def wait_for(condition: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if condition():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


# ---------------------------------------------------------------------------------------
# A split server and its processes
# ---------------------------------------------------------------------------------------


@dataclass
class Split:
    server: ServerProcess
    metrics_port: int

    def processes(self, role: str) -> list[psutil.Process]:
        """The supervisor's children of one role ("engine" or "frontend"), by index."""
        found = []
        for child in psutil.Process(self.server.process.pid).children():
            try:
                cmdline = child.cmdline()
            except psutil.NoSuchProcess:
                continue
            if "--role" in cmdline and cmdline[cmdline.index("--role") + 1] == role:
                index = int(cmdline[cmdline.index("--role-index") + 1])
                found.append((index, child))
        return [child for _, child in sorted(found, key=lambda pair: pair[0])]

    def frontend_sockets(self, status: str) -> list[int]:
        """Each front end's TCP sockets on the gRPC port in `status` (LISTEN, ESTABLISHED),
        its Node.js door's among them where Node serves gRPC."""
        counts = []
        for frontend in self.processes("frontend"):
            sockets = [
                s
                for process in (frontend, *frontend.children())
                for s in process.net_connections(kind="tcp")
            ]
            counts.append(
                sum(1 for s in sockets if s.status == status and s.laddr.port == self.server.port)
            )
        return counts

    def scrape(self) -> dict[str, list[Any]]:
        return scrape(self.metrics_port)

    def queue_depth(self) -> float:
        return metric_sum(self.scrape(), "pooling_queue_depth")


def start_split(args: list[str], log_dir: Path, name: str, frontends: int = 2) -> Split:
    """Start the server and wait until it is SERVING and every front end listens."""
    metrics_port = free_port()
    args = [*args, "--frontends", str(frontends), "--metrics-port", str(metrics_port)]
    server = start_server(args, log_dir, name)
    split = Split(server, metrics_port)
    try:
        assert len(split.processes("frontend")) == frontends, server.log()
        listening = wait_for(lambda: all(split.frontend_sockets(psutil.CONN_LISTEN)), WAIT_S)
        assert listening, f"not every front end listens:\n{server.log()}"
    except BaseException:
        stop_split(split)
        raise
    return split


def stop_split(split: Split) -> None:
    """SIGTERM the supervisor; whatever of its children is left after that is killed."""
    children = []
    if split.server.process.poll() is None:
        children = psutil.Process(split.server.process.pid).children(recursive=True)
    split.server.stop(signal.SIGTERM, timeout=30)
    for child in children:
        if child.is_running():
            child.kill()


@contextmanager
def spread_channels(split: Split, count: int = 4, most: int = 32) -> Iterator[list[grpc.Channel]]:
    """At least `count` channels, each its own connection, with every front end holding one."""
    channels: list[grpc.Channel] = []
    try:
        while True:
            while len(channels) < count:
                options = [("grpc.use_local_subchannel_pool", 1)]
                channels.append(grpc.insecure_channel(split.server.address, options=options))
                grpc.channel_ready_future(channels[-1]).result(timeout=WAIT_S)
            if wait_for(lambda: all(split.frontend_sockets(psutil.CONN_ESTABLISHED)), 0.5):
                break
            counts = split.frontend_sockets(psutil.CONN_ESTABLISHED)
            assert count < most, f"{count} connections, none to some front end: {counts}"
            count += 1
        yield channels
    finally:
        for channel in channels:
            channel.close()


def spread_pools(split: Split, requests: list[pb.PoolRequest], count: int) -> list[Any]:
    """Every request at once, over spread_channels' `count` connections in turn; the answers
    in the requests' order."""
    with spread_channels(split, count=count) as channels:
        stubs = [Stub(channel) for channel in channels]
        futures = [
            stubs[i % len(stubs)].Pool.future(request, timeout=WAIT_S)
            for i, request in enumerate(requests)
        ]
        return [future.result() for future in futures]


def health(channel: grpc.Channel) -> int | None:
    """The health status over this channel, or None if the call failed."""
    try:
        request = health_pb2.HealthCheckRequest(service="")
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=5).status
    except grpc.RpcError:
        return None


class Delta:
    """Metric changes since it was made."""

    def __init__(self, split: Split) -> None:
        self.split = split
        self.before = split.scrape()

    def __call__(self, name: str, **labels: str) -> float:
        after = self.split.scrape()
        return metric_sum(after, name, **labels) - metric_sum(self.before, name, **labels)


# ---------------------------------------------------------------------------------------
# Flags and ports
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--frontends", "2", "--port", "0"], "--frontends above 1 needs a fixed --port"),
        (["--processes", "2", "--port", "0"], "--frontends above 1 needs a fixed --port"),
        (["--frontends", "-1"], "--frontends: must be auto, 0 (one process) or more"),
    ],
)
def test_front_end_count_checks(args: list[str], message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pooling_server.service.launch", *args],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert result.returncode != 0
    assert message in result.stderr


def test_without_several_front_ends_a_taken_port_is_an_error(
    model_folders: dict[str, Path],
) -> None:
    """SO_REUSEPORT is on only for --frontends above 1: a server must not join a port by
    mistake. The port's holder allows sharing, so only the newcomer's own setting refuses."""
    model = f"tiny-bert={model_folders['tiny-bert']}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with socket.socket() as holder, socket.socket() as sharer:
        for sock in (holder, sharer):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        sharer.bind(("127.0.0.1", port))  # what a server with SO_REUSEPORT would manage
        command = [
            sys.executable,
            "-m",
            "pooling_server.service.launch",
            "--model",
            model,
            "--port",
            str(port),
        ]
        started = {
            frontends: subprocess.Popen(
                [*command, "--frontends", frontends],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
            )
            for frontends in ("0", "1")
        }
        try:
            outputs = {n: p.communicate(timeout=WAIT_S)[0] for n, p in started.items()}
        finally:
            for process in started.values():
                if process.poll() is None:
                    process.kill()
                    process.wait()
    for frontends, process in started.items():
        assert process.returncode != 0, outputs[frontends]
        assert "cannot listen" in outputs[frontends], outputs[frontends]


# ---------------------------------------------------------------------------------------
# Two front ends over two engines: same answers, one metrics endpoint, a lossless drain
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_by_two(
    model_folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Split]:
    args = [*server_args(mixed_models(model_folders)), "--engines-per-device", "2"]
    args += ["--dtype", "float32", "--drain-delay-s", str(DRAIN_DELAY_S), "--batch-wait-ms", "20"]
    split = start_split(args, tmp_path_factory.mktemp("two-by-two"), "two-by-two")
    yield split
    stop_split(split)


def parity_requests(count: int = 44) -> list[pb.PoolRequest]:
    """Every task, with params mixed so that per-request heads differ within a batch."""
    return mixed_requests(MIXED_KINDS, count, phrase, query="where is the mill")


def test_two_front_ends_over_two_engines_answer_as_one_by_one_calls(two_by_two: Split) -> None:
    """Every task, with per-request params mixed within batches, over both front ends."""
    requests = parity_requests()
    with spread_channels(two_by_two, count=6) as channels:
        stubs = [Stub(channel) for channel in channels]
        batches = Delta(two_by_two)
        alone = [stubs[i % len(stubs)].Pool(r, timeout=WAIT_S) for i, r in enumerate(requests)]
        alone_batches = batches("pooling_batch_size_count")
        assert {response.WhichOneof("output") for response in alone} == {
            "embed",
            "classify",
            "score",
            "token_embed",
            "token_classify",
        }
        batches = Delta(two_by_two)
        burst = [
            stubs[i % len(stubs)].Pool.future(request, timeout=WAIT_S)
            for i, request in enumerate(requests)
        ]
        for future, want in zip(burst, alone, strict=True):
            assert_same_response(future.result(), want)
        # Fewer batches than alone: some held several requests (and differing params).
        assert batches("pooling_batch_size_count") < alone_batches


def _native_libraries(process: psutil.Process) -> set[str]:
    """The folders under site-packages of the shared libraries `process` has mapped."""
    maps = Path(f"/proc/{process.pid}/maps").read_text()
    found = set()
    for line in maps.splitlines():
        path = line.split()[-1]
        if path.endswith(".so") and "site-packages/" in path:
            found.add(path.split("site-packages/", 1)[1].split("/", 1)[0])
    return found


def test_engine_processes_hold_no_grpc_nor_aiohttp(two_by_two: Split) -> None:
    """The live engines, models loaded and serving, have not loaded grpc's or aiohttp's
    native code; the front ends have (so the check sees them where they are)."""
    for engine in two_by_two.processes("engine"):
        assert not {"grpc", "aiohttp"} & _native_libraries(engine), engine.cmdline()
    for frontend in two_by_two.processes("frontend"):
        assert {"grpc", "aiohttp"} <= _native_libraries(frontend), frontend.cmdline()


def test_one_metrics_endpoint_counts_every_front_ends_requests(two_by_two: Split) -> None:
    calls = 30
    delta = Delta(two_by_two)
    requests = [text_request("embed", f"count-{i}", [phrase(i)]) for i in range(calls)]
    spread_pools(two_by_two, requests, count=6)
    wait_for(lambda: delta("pooling_requests_total") >= calls, 5)
    pool = {"rpc": "Pool", "task": "embed", "model": "tiny-bert"}
    assert delta("pooling_requests_total", **pool, code="OK") == calls
    assert delta("pooling_requests_total") == calls
    assert delta("pooling_items_total", model="tiny-bert", task="embed") == calls
    # The engines' batch figures reach the same endpoint: every item computed once.
    assert delta("pooling_batch_size_sum", model="tiny-bert") == calls
    assert delta("pooling_queue_seconds_count", model="tiny-bert") == calls


def test_drain_with_two_front_ends_under_load_loses_nothing(two_by_two: Split) -> None:
    """SIGTERM: NOT_SERVING for --drain-delay-s while still serving, then new calls are
    refused (UNAVAILABLE, which a client retries elsewhere) and every accepted one finishes."""
    outcomes: list[tuple[float, grpc.StatusCode, str | None]] = []
    lock = threading.Lock()
    give_up = time.monotonic() + WAIT_S

    def load(stub: Stub, thread: int) -> None:
        call = 0
        while time.monotonic() < give_up:
            sent = time.monotonic()
            request = text_request("embed", f"drain-{thread}-{call}", [phrase(thread, call)])
            try:
                stub.Pool(request, timeout=WAIT_S)
                outcome = (sent, grpc.StatusCode.OK, None)
            except grpc.RpcError as error:
                decoded = decode_rpc_error(error)
                outcome = (sent, decoded.code, decoded.reason or decoded.message)
            with lock:
                outcomes.append(outcome)
            if outcome[1] != grpc.StatusCode.OK:
                return  # refused: this server is going away
            call += 1
            time.sleep(0.01)

    with spread_channels(two_by_two, count=6) as channels:
        threads = [
            threading.Thread(target=load, args=(Stub(channel), k), daemon=True)
            for k, channel in enumerate(channels)
        ]
        for thread in threads:
            thread.start()
        assert wait_for(lambda: len(outcomes) >= 4 * len(threads), 30)
        sigterm_at = time.monotonic()
        two_by_two.server.process.send_signal(signal.SIGTERM)
        not_serving = wait_for(lambda: health(channels[0]) == NOT_SERVING, 0.8)
        for thread in threads:
            thread.join(WAIT_S)
        assert not any(thread.is_alive() for thread in threads)
        exit_code = two_by_two.server.process.wait(WAIT_S)

    assert exit_code == 0, two_by_two.server.log()[-3000:]
    assert not_serving, "health did not turn NOT_SERVING during the drain delay"
    # Every call sent well inside the drain delay was served; some were sent after SIGTERM.
    cut = sigterm_at + DRAIN_DELAY_S
    early = [o for o in outcomes if o[0] < cut - CUT_MARGIN_S]
    assert all(code == grpc.StatusCode.OK for _, code, _ in early), early
    assert any(sent >= sigterm_at for sent, _, _ in early), "no call was served in the delay"
    # After the cut new calls are refused: UNAVAILABLE, which clients retry elsewhere, never
    # ENGINE_DEAD. A call reaching a front end at the very moment its listener closes is
    # CANCELLED by grpc core unseen by any handler (grpc/grpc#41785; --frontends 0 does the
    # same), so that code is accepted only at the cut.
    failed = [o for o in outcomes if o[1] != grpc.StatusCode.OK]
    assert len(failed) == len(threads)  # each thread stopped at its first refusal
    for sent, code, reason in failed:
        assert sent >= cut - CUT_MARGIN_S, failed
        assert code == grpc.StatusCode.UNAVAILABLE or (
            code == grpc.StatusCode.CANCELLED and sent < cut + CUT_MARGIN_S
        ), failed
        assert reason != "ENGINE_DEAD", failed


# ---------------------------------------------------------------------------------------
# Two front ends over one engine that waits for batches to fill
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def batching(
    model_folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Split]:
    args = ["--model", f"tiny-bert={model_folders['tiny-bert']}"]
    args += ["--batch-wait-ms", str(BATCH_WAIT_MS), "--drain-delay-s", str(DRAIN_DELAY_S)]
    split = start_split(args, tmp_path_factory.mktemp("batching"), "batching")
    yield split
    stop_split(split)


def test_one_batch_holds_items_from_both_front_ends(batching: Split) -> None:
    """Texts of one length, so that the one batch the queue forms after its wait takes all."""
    calls = 16
    delta = Delta(batching)
    requests = [
        text_request("embed", f"mixed-{i}", ["one text from every caller"]) for i in range(calls)
    ]
    for answer in spread_pools(batching, requests, count=8):
        assert len(answer.embed.embeddings) == 1
    assert wait_for(lambda: delta("pooling_mixed_batches_total", model="tiny-bert") > 0, 5)
    assert delta("pooling_batch_size_sum", model="tiny-bert") == calls


def test_cancelling_through_a_front_end_drops_the_queued_items(batching: Split) -> None:
    """Calls cancelled by the client, or past their deadline, while their items wait in the
    engine's queue: the items are dropped there, never computed, and the server serves on."""
    delta = Delta(batching)
    with spread_channels(batching, count=4) as channels:
        stubs = [Stub(channel) for channel in channels]

        def call(i: int, timeout: float) -> grpc.Future:
            request = text_request("embed", f"cancel-{i}", [phrase(i)])
            return stubs[i % len(stubs)].Pool.future(request, timeout=timeout)

        cancelled = [call(i, WAIT_S) for i in range(4)]
        assert wait_for(lambda: batching.queue_depth() == 4, BATCH_WAIT_MS / 2000)
        for future in cancelled:
            future.cancel()
        expiring = [call(i, 0.6) for i in range(4, 8)]
        for future in expiring:
            assert future.exception(WAIT_S).code() == grpc.StatusCode.DEADLINE_EXCEEDED  # type: ignore[union-attr]
        assert all(future.cancelled() for future in cancelled)

        def dropped() -> float:
            return delta("pooling_dropped_items_total")

        assert wait_for(lambda: dropped() >= 8, BATCH_WAIT_MS / 1000 + 5)
        assert dropped() == 8
        assert delta("pooling_dropped_items_total", reason="cancelled") >= len(cancelled)
        assert batching.queue_depth() == 0
        assert delta("pooling_batch_size_count", model="tiny-bert") == 0  # nothing computed

        response = stubs[0].Pool(text_request("embed", "after", ["still serving"]), timeout=30)
        assert len(response.embed.embeddings) == 1


def test_killing_the_engine_fails_calls_in_flight_and_stops_the_server(batching: Split) -> None:
    (engine,) = batching.processes("engine")
    children = psutil.Process(batching.server.process.pid).children()
    with spread_channels(batching, count=4) as channels:
        stubs = [Stub(channel) for channel in channels]
        futures = [
            stubs[i % len(stubs)].Pool.future(
                text_request("embed", f"lost-{i}", [phrase(i)]), timeout=WAIT_S
            )
            for i in range(6)
        ]
        assert wait_for(lambda: batching.queue_depth() == 6, BATCH_WAIT_MS / 2000)
        killed_at = time.monotonic()
        engine.kill()
        errors = [decode_rpc_error(future.exception(WAIT_S)) for future in futures]  # type: ignore[arg-type]
        failed_within = time.monotonic() - killed_at
        status = health(channels[0])  # the front ends drain for --drain-delay-s
        exit_code = batching.server.process.wait(WAIT_S)
        exited_within = time.monotonic() - killed_at

    for error in errors:
        assert error.code == grpc.StatusCode.UNAVAILABLE, error
        assert error.reason == "ENGINE_DEAD", error
        assert error.retry is not None
    assert failed_within < 5
    assert status == NOT_SERVING
    assert exit_code != 0
    assert exited_within < 15
    assert not any(child.is_running() for child in children)


# ---------------------------------------------------------------------------------------
# A front end dying
# ---------------------------------------------------------------------------------------


def test_killing_a_front_end_stops_the_server(
    model_folders: dict[str, Path], tmp_path: Path
) -> None:
    args = ["--model", f"tiny-bert={model_folders['tiny-bert']}"]
    split = start_split(args, tmp_path, "frontend-killed")
    try:
        first, _ = split.processes("frontend")
        others = [c for c in psutil.Process(split.server.process.pid).children() if c != first]
        assert len(others) == 2  # the other front end and the engine
        doors = first.children()  # its Node.js door, where Node serves gRPC
        first.kill()
        assert split.server.process.wait(WAIT_S) != 0
        assert not any(child.is_running() for child in others)
        _, left = psutil.wait_procs(doors, timeout=WAIT_S)
        assert not left, "a killed front end's Node.js door outlived it"
    finally:
        stop_split(split)


# ---------------------------------------------------------------------------------------
# The front end's engine client, without processes
# ---------------------------------------------------------------------------------------


def test_a_cancelled_job_is_no_longer_outstanding(tmp_path: Path) -> None:
    """The engine answers nothing for a cancelled job; the front end must forget it, or the
    engine looks busy for ever and every later job goes to the other one."""

    async def scenario() -> list[tuple[int, type]]:
        listeners, addresses = [], [f"{tmp_path}/engine-{k}.sock" for k in range(2)]
        for address in addresses:
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(address)
            listener.listen(1)
            listeners.append(listener)
        ready = [EngineReady(address, 0, []) for address in addresses]
        client = RemoteEngineClient(ready, stall_s=0)  # no Ping among the messages counted
        await client.start()
        engines = [Link(listener.accept()[0]) for listener in listeners]
        loop = asyncio.get_running_loop()
        received: list[tuple[int, type]] = []

        def receive() -> None:
            ready, _, _ = select.select([link.sock for link in engines], [], [], 5.0)
            for sock in ready:
                index = [link.sock for link in engines].index(sock)
                message = engines[index].read()
                assert message is not None
                received.append((index, type(to_engine_decoder.decode(message[0]))))

        def job() -> Job:
            sequence = TokenSequence([101, 7, 102], None, [], [])
            return Job([(sequence, False)], lambda raws: raws, loop.create_future())

        try:
            first = job()
            assert client.submit("tiny-bert", [first]) == []
            receive()
            first.future.cancel()
            client.cancel(first)
            receive()
            assert client.submit("tiny-bert", [job()]) == []
            receive()
        finally:
            await client.stop()
            for link in engines:
                link.close()
            for listener in listeners:
                listener.close()
        return received

    assert asyncio.run(scenario()) == [(0, Submit), (0, Cancel), (0, Submit)]
