"""Loading at run time stalls no other model, and load/unload cycles leak no memory.

One real server in its default layout (a front end and an engine process) with MiniLM
served from the start: the bystander. Quiet, since it times the bystander's calls.

- While MiniLM loads again under another name (weights read on a worker thread of the
  engine, warmed on the new queue's own workers), the bystander's calls on the first
  MiniLM take at most the issue's 100 ms longer at the 95th percentile than before any
  load: the target, reported and warned past; the test fails past twice it (a 2-core host
  reading weights beside the bystander ran at +107 ms once, quiet).
- 50 load/unload cycles of a model with MiniLM's width and vocabulary (47 MB of word
  embeddings a copy) leave the server's processes within 100 MB of where they began
  (measured after two warm-up cycles: the first load pays its imports once).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psutil
import pytest

from pooling_client import PoolingClient
from tests.fixture_models import MINILM, wide_bert
from tests.reliability.attack_kit import Bound
from tests.server_process import ServerProcess, running_server

pytestmark = pytest.mark.quiet  # times a bystander: `make test` runs it with nothing beside it

ADMIN = "quiet-admin"
# The bystander's added p95 latency while a model loads: issue 46's 100 ms as the target.
ADDED_LATENCY = Bound(target_s=0.1, limit_s=0.2)
CYCLES = 50
MEMORY_BOUND = 100 * 1024 * 1024


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return wide_bert(tmp_path_factory.mktemp("wide") / "wide-bert")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args = ["--model", f"minilm={MINILM}", "--backend", "torch", "--dtype", "float32"]
    args += ["--admin-key", ADMIN, "--frontends", "1"]
    yield from running_server(args, tmp_path_factory.mktemp("logs"), "loading")


def bystander_latencies(server: ServerProcess, stop: threading.Event) -> list[float]:
    """One call after another on the pinned MiniLM until `stop`; each call's seconds."""
    seconds: list[float] = []
    with PoolingClient(server.address, timeout=60) as client:
        while not stop.is_set():
            started = time.perf_counter()
            client.embed(["a bystander's short sentence"], model="minilm")
            seconds.append(time.perf_counter() - started)
    return seconds


def timed(server: ServerProcess, work: object) -> list[float]:
    stop = threading.Event()
    latencies: list[float] = []
    thread = threading.Thread(target=lambda: latencies.extend(bystander_latencies(server, stop)))
    thread.start()
    try:
        work()  # type: ignore[operator]
    finally:
        stop.set()
        thread.join(60)
    return latencies


def test_a_load_adds_at_most_100ms_for_a_bystander(server: ServerProcess) -> None:
    with PoolingClient(server.address, timeout=300, admin_key=ADMIN) as admin:

        def load_and_unload() -> None:
            for _ in range(3):
                admin.load_model("minilm-2", str(MINILM), options={"backend": "torch"})
                admin.unload_model("minilm-2")

        admin.load_model("minilm-2", str(MINILM), options={"backend": "torch"})  # warm-up
        admin.unload_model("minilm-2")
        baseline = timed(server, lambda: time.sleep(5))
        loading = timed(server, load_and_unload)
    before, during = np.percentile(baseline, 95), np.percentile(loading, 95)
    print(
        f"bystander p95 {before * 1000:.1f} ms before, {during * 1000:.1f} ms while loading "
        f"({len(loading)} calls; max {max(loading) * 1000:.1f} ms)"
    )
    ADDED_LATENCY.check(during - before, "the bystander's added p95 latency")


def test_50_load_unload_cycles_leave_memory_where_it_began(
    server: ServerProcess, wide: Path
) -> None:
    def rss() -> int:
        root = psutil.Process(server.process.pid)
        return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])

    with PoolingClient(server.address, timeout=120, admin_key=ADMIN) as admin:

        def cycle() -> None:
            admin.load_model("wide", str(wide), options={"backend": "torch"})
            admin.embed(["one call on it"], model="wide")
            admin.unload_model("wide")

        cycle()
        cycle()
        began = rss()
        for _ in range(CYCLES):
            cycle()
        ended = rss()
    print(f"server memory {began >> 20} MB before {CYCLES} cycles, {ended >> 20} MB after")
    assert ended - began <= MEMORY_BOUND
