"""Two replicas behind one client: round-robin spreading, and losing a replica mid-load.

The client gets a static list of loopback replicas (an `ipv4:` target), balances calls
round-robin and retries calls that hit a replica going away (UNAVAILABLE) on the other one.
"""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pooling_client import PoolingClient
from tests.metrics_endpoint import metric_sum, scrape
from tests.server_process import ServerProcess, free_port, start_server
from tests.service.embed_tally import EmbedTally

THREADS = 4
CALLS_PER_THREAD = 50
PACE_S = 0.03  # between a thread's calls, so the load spans the whole shutdown
CALL_TIMEOUT_S = 30.0


@dataclass
class Replica:
    server: ServerProcess
    metrics_port: int

    def ok_requests(self) -> float:
        """Sum of pooling_requests_total{code="OK"} over every rpc, task and model."""
        return metric_sum(scrape(self.metrics_port), "pooling_requests_total", code="OK")


def start_replicas(tmp_path: Path, wanted: dict[str, list[str]]) -> dict[str, Replica]:
    """Start a replica per name in `wanted` (its extra flags) at once; each waits for its own
    SERVING."""

    def start(name: str) -> Replica:
        metrics_port = free_port()
        args = ["--metrics-port", str(metrics_port), "--metrics-host", "127.0.0.1"]
        return Replica(start_server([*args, *wanted[name]], tmp_path, name), metrics_port)

    with ThreadPoolExecutor(len(wanted)) as pool:
        futures = {name: pool.submit(start, name) for name in wanted}
    failures = [f.exception() for f in futures.values() if f.exception() is not None]
    if failures:
        for f in futures.values():
            if f.exception() is None:
                f.result().server.stop(signal.SIGKILL)
        raise failures[0]  # type: ignore[misc]
    return {name: f.result() for name, f in futures.items()}


# Replicas by role, shared by the module's tests: "steady" is never stopped, "victim" is
# killed by one test and "drained" drains in another. The first test to ask starts all three
# side by side; a role an earlier test stopped starts again when asked for. Sharing them
# halves the module's server starts; the tests count a replica's requests as differences,
# so its earlier calls count for nothing.
ROLES = {"steady": [], "victim": [], "drained": ["--drain-delay-s", "1.0"]}


@pytest.fixture(scope="module")
def replicas_by_role(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    running: dict[str, Replica] = {}
    log_dir = tmp_path_factory.mktemp("replicas")

    def take(*roles: str) -> list[Replica]:
        wanted = roles if running else tuple(ROLES)
        missing = [
            r for r in wanted if r not in running or running[r].server.process.poll() is not None
        ]
        if missing:
            running.update(start_replicas(log_dir, {role: ROLES[role] for role in missing}))
        return [running[role] for role in roles]

    yield take
    for replica in running.values():
        replica.server.stop(signal.SIGKILL)


@dataclass
class Load(EmbedTally):
    """THREADS threads, each making CALLS_PER_THREAD paced embed calls through one client."""

    client: PoolingClient
    started_at: list[float] = field(default_factory=list)

    def worker(self, index: int) -> None:
        for i in range(CALLS_PER_THREAD):
            with self.lock:
                self.started_at.append(time.monotonic())
            self.embed(self.client, f"thread {index} call {i}", timeout=CALL_TIMEOUT_S)
            time.sleep(PACE_S)

    def run_until(self, trigger_after: int, action) -> float:  # type: ignore[no-untyped-def]
        """Run the load; once `trigger_after` calls succeeded, run `action`; return its time."""
        threads = [
            threading.Thread(target=self.worker, args=(i,), daemon=True) for i in range(THREADS)
        ]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 30
        while self.ok + len(self.errors) < trigger_after and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.ok >= trigger_after, (self.ok, self.errors[:5])
        acted_at = time.monotonic()
        action()
        for thread in threads:
            thread.join(CALLS_PER_THREAD * (CALL_TIMEOUT_S + 1))
        assert not any(thread.is_alive() for thread in threads)
        return acted_at

    def started_after(self, moment: float) -> int:
        return sum(started > moment for started in self.started_at)


def test_round_robin_spreads_calls_over_both_replicas(replicas_by_role) -> None:  # type: ignore[no-untyped-def]
    replicas = replicas_by_role("steady", "victim")
    before = [replica.ok_requests() for replica in replicas]
    targets = [replica.server.address for replica in replicas]
    with PoolingClient(targets, timeout=CALL_TIMEOUT_S) as client:
        for i in range(60):
            assert len(client.embed([f"spread {i}"])[0].outputs.embedding) == 384
    counts = [replica.ok_requests() - b for replica, b in zip(replicas, before, strict=True)]
    assert sum(counts) == 60, counts
    assert all(count > 0 for count in counts), counts


def test_sigkill_of_a_replica_mid_load_loses_no_call(replicas_by_role) -> None:  # type: ignore[no-untyped-def]
    victim, survivor = replicas_by_role("victim", "steady")
    survivor_before = survivor.ok_requests()
    targets = [victim.server.address, survivor.server.address]
    with PoolingClient(targets, timeout=CALL_TIMEOUT_S) as client:
        load = Load(client)
        killed_at = load.run_until(40, lambda: victim.server.process.send_signal(signal.SIGKILL))
    assert victim.server.process.wait(10) == -signal.SIGKILL
    assert load.errors == [], load.errors[:10]
    assert load.ok == THREADS * CALLS_PER_THREAD
    # The test's premise: plenty of calls were made after the kill, all on the survivor.
    after = load.started_after(killed_at)
    assert after >= 60, after
    assert survivor.ok_requests() - survivor_before >= after


# The client health-checks replicas (healthCheckConfig), so it stops sending to a draining
# replica during its drain delay, before grpcio would cancel calls not yet handled.
def test_sigterm_drain_of_a_replica_mid_load_loses_no_call(replicas_by_role) -> None:  # type: ignore[no-untyped-def]
    drain_delay_s = float(ROLES["drained"][1])
    drained, survivor = replicas_by_role("drained", "steady")
    survivor_before = survivor.ok_requests()
    targets = [drained.server.address, survivor.server.address]
    with PoolingClient(targets, timeout=CALL_TIMEOUT_S) as client:
        load = Load(client)
        term_at = load.run_until(40, lambda: drained.server.process.send_signal(signal.SIGTERM))
    assert drained.server.process.wait(30) == 0, drained.server.log()
    assert load.errors == [], load.errors[:10]
    assert load.ok == THREADS * CALLS_PER_THREAD
    # The test's premise: the load went on past the drain delay, when the listener closed.
    assert load.started_after(term_at + drain_delay_s + 0.3) >= 20
    after_listener_closed = load.started_after(term_at + drain_delay_s + 0.3)
    assert survivor.ok_requests() - survivor_before >= after_listener_closed
