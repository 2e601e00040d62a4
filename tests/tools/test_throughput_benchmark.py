"""benchmarks/throughput.py's CPU accounting and its call-cpu rows, run for real in a quick
mode: the figures are only read, never judged (speed is not what a test can hold here), but
every process is found, named by role, and summed where the row says."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks import gpu, processes

REPO = Path(__file__).resolve().parents[2]
# A stand-in for a split server: a parent that only waits (a supervisor, by process_role,
# since its child's command line has --role) and a child that spins (an engine).
SPIN = "import time\nend = time.monotonic() + 60\nwhile time.monotonic() < end: pass"
PARENT = (
    "import subprocess, sys, time\n"
    f"child = subprocess.Popen([sys.executable, '-c', {SPIN!r}, '--role', 'engine'])\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)


@pytest.fixture
def supervised_spinner() -> Iterator[int]:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None and parent.stdout.readline().strip() == "ready"
    while len(processes.process_tree(parent.pid)) < 2:
        time.sleep(0.05)
    try:
        yield parent.pid
    finally:
        for process in reversed(processes.process_tree(parent.pid)):
            process.kill()
        parent.wait()


def test_role_cpu_names_each_process_by_role(supervised_spinner: int) -> None:
    probe = processes.RoleCpu(roles_of=supervised_spinner)
    probe.start()
    time.sleep(0.5)
    probe.stop()
    report = probe.report(requests_per_s=100.0)
    assert set(report) == {"supervisor", "engine 0"}
    assert report["engine 0"]["cores"] > 0
    assert report["engine 0"]["cpu_us_per_request"] > 0


def test_whole_trees_and_the_rest_of_the_machine(supervised_spinner: int) -> None:
    probe = processes.ProcessCpu({"server": supervised_spinner})
    probe.start()
    time.sleep(0.5)
    probe.stop()
    report = probe.report(requests_per_s=0.0)
    assert report["server_cores"] > 0  # the spinning child counts in its parent's tree
    assert report["server_cpu_us_per_request"] is None  # no requests, no division
    assert "other_cores" in report


def test_the_gpu_window_reads_the_same_cpu_by_kind(supervised_spinner: int) -> None:
    window = gpu.Window(supervised_spinner, gpu=None)
    window.start()
    time.sleep(0.3)
    window.stop()
    report = window.report()
    assert set(report["cores_by_role"]) == {"engine", "supervisor"}
    assert report["gpu_busy_pct"] is None


def test_role_kinds() -> None:
    assert [processes.role_kind(n) for n in ("frontend 3", "node of frontend 0", "engine 1")] == [
        "frontend",
        "node",
        "engine",
    ]


def test_serving_processes_are_front_ends_doors_and_whole_servers() -> None:
    names = ["frontend 1", "node of frontend 1", "server", "node of server", "engine 0"]
    assert [processes.serves_calls(n) for n in [*names, "supervisor"]] == [
        True,
        True,
        True,
        True,
        False,
        False,
    ]


@pytest.mark.skipif(shutil.which("h2load") is None, reason="h2load not on PATH (nghttp2-client)")
@pytest.mark.skipif(shutil.which("node") is None, reason="the Node.js door needs node")
def test_call_cpu_rows_in_a_quick_run(tmp_path: Path) -> None:
    """The group call-cpu: both floors and both doors' rows, a second each at C=4 (CPU is read
    over the middle 0.4 s, clear of h2load's phase changes)."""
    out = tmp_path / "result.json"
    command = [
        *(sys.executable, "-m", "benchmarks.throughput", "--load", "h2load"),
        *("--only", "call-cpu", "--concurrency", "4"),
        *("--duration", "1", "--warmup", "0.3", "--json-out", str(out)),
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "CPU per unary one-text call" in done.stdout
    result = json.loads(out.read_text())
    rows = {r["row"]: r for r in result["rows"]}
    assert set(rows) == {"floor", "floor-asyncio", "call-cpu-node", "call-cpu-grpcio"}
    for name, door in (("call-cpu-node", "node"), ("call-cpu-grpcio", "grpcio")):
        row, serving = rows[name], rows[name]["serving"]
        assert row["failed"] == 0 and row["errored"] == 0
        assert serving["door"] == door
        kinds = {processes.role_kind(k) for k in row["server_cores_by_process"]}
        assert {"supervisor", "engine", "frontend"} <= kinds
        assert ("node" in kinds) == (door == "node")  # the door's own process, when it has one
        serving_us = sum(
            v["cpu_us_per_request"]
            for k, v in row["server_cores_by_process"].items()
            if processes.serves_calls(k)
        )
        assert serving["cpu_us_per_request"] == pytest.approx(serving_us)
        assert serving_us > 0  # the front end's CPU was seen at all
        assert serving["over_floor"] is not None
        assert result["summary"][f"call_cpu_{door}_serving_us_c4"] == serving["cpu_us_per_request"]
