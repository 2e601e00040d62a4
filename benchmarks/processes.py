"""The processes of a benchmark run: which process of a server is which, what each used, and
the measuring roles run each in a process of its own.

Every benchmark reads CPU the same way (ProcessCpu), so a figure from throughput.py, gpu.py or
backends.py means the same thing: CPU seconds from /proc over a window, divided by the calls
answered in that window.
"""

from __future__ import annotations

import contextlib
import json
import math
import resource
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import psutil

MB = 1024 * 1024
MACHINE = "machine"


def process_tree(pid: int) -> list[psutil.Process]:
    parent = psutil.Process(pid)
    return [parent, *parent.children(recursive=True)]


def process_role(process: psutil.Process) -> str:
    """supervisor, engine K or frontend K (from a split server's child command line),
    server (the whole server in one process), or `node of P`: process P's Node.js door."""
    command = process.cmdline()
    if process.name() == "node":
        return f"node of {process_role(process.parent())}"
    if "--role" in command:
        role = command[command.index("--role") + 1]
        index = command[command.index("--role-index") + 1] if "--role-index" in command else "0"
        return f"{role} {index}"
    split = any("--role" in child.cmdline() for child in process.children())
    return "supervisor" if split else "server"


def role_kind(name: str) -> str:
    """process_role's names, by kind: `frontend 2` -> frontend, `node of frontend 0` -> node
    (the Node.js door), supervisor, engine, server; `load 1` -> load."""
    return "node" if name.startswith("node") else name.split()[0]


def serves_calls(name: str) -> bool:
    """Whether a process answers gRPC calls itself: a front end, its door, or a whole server.
    The supervisor only watches; an engine runs forward passes for every front end."""
    return role_kind(name) not in ("supervisor", "engine")


def machine_busy() -> float:
    """CPU seconds the whole machine has spent not idle, over all cores."""
    times = psutil.cpu_times()
    return sum(times) - times.idle - getattr(times, "iowait", 0.0)


def wait_quiet(max_wait_s: float, busy_cores: float = 0.3) -> float:
    """Wait (at most max_wait_s) for a second in which the machine is nearly idle, so a row
    is not measured while other work has the cores; returns the busy cores seen last."""
    deadline = time.monotonic() + max_wait_s
    while True:
        before, started = machine_busy(), time.perf_counter()
        time.sleep(1.0)
        busy = (machine_busy() - before) / (time.perf_counter() - started)
        if busy <= busy_cores or time.monotonic() >= deadline:
            return busy


def children_cpu() -> float:
    """CPU seconds of this process's finished children (the role processes)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@dataclass
class ProcessCpu:
    """CPU of named groups of processes over a window -> cores, and microseconds per request.

    `pids`: each counted with every child it has when the window opens (a whole server,
    h2load). `roles_of`: a server whose processes are counted one by one, named by
    process_role, so a split server's front ends, doors and engines show apart. The groups
    are fixed when the window opens; a process that ends inside it is left out of both ends.
    """

    pids: Mapping[str, int] = field(default_factory=dict)
    roles_of: int | None = None
    _groups: dict[str, list[psutil.Process]] = field(default_factory=dict)
    _before: dict[int, float] = field(default_factory=dict)
    _after: dict[int, float] = field(default_factory=dict)
    _busy: list[float] = field(default_factory=list)
    _t: list[float] = field(default_factory=list)

    def _find_groups(self) -> dict[str, list[psutil.Process]]:
        groups: dict[str, list[psutil.Process]] = {}
        for name, pid in self.pids.items():
            with contextlib.suppress(psutil.NoSuchProcess):
                groups[name] = process_tree(pid)
        if self.roles_of is not None:
            for process in process_tree(self.roles_of):
                with contextlib.suppress(psutil.NoSuchProcess):
                    groups[process_role(process)] = [process]
        return groups

    def _cpu(self) -> dict[int, float]:
        out = {}
        for group in self._groups.values():
            for process in group:
                with contextlib.suppress(psutil.NoSuchProcess):
                    times = process.cpu_times()
                    out[process.pid] = times.user + times.system
        return out

    def start(self) -> None:
        self._groups = self._find_groups()
        self._t = [time.perf_counter()]
        self._busy = [machine_busy()]
        self._before = self._cpu()

    def stop(self) -> None:
        self._after = self._cpu()
        self._busy.append(machine_busy())
        self._t.append(time.perf_counter())

    @property
    def seconds(self) -> float:
        return self._t[1] - self._t[0]

    def used(self) -> dict[str, float]:
        """CPU seconds of each group over the window."""
        out = {}
        for name, group in self._groups.items():
            pids = [p.pid for p in group if p.pid in self._before and p.pid in self._after]
            if pids:
                out[name] = sum(self._after[pid] - self._before[pid] for pid in pids)
        return out

    def usage(self, requests_per_s: float) -> dict[str, dict[str, float | None]]:
        """{group: {cores, cpu_us_per_request}}, the groups in name order."""
        requests = requests_per_s * self.seconds
        return {
            name: {
                "cores": used / self.seconds,
                "cpu_us_per_request": 1e6 * used / requests if requests else None,
            }
            for name, used in sorted(self.used().items())
        }

    def report(self, requests_per_s: float) -> dict[str, Any]:
        """`{group}_cpu_us_per_request` and `{group}_cores` for each group, and `other_cores`:
        what the rest of the machine took meanwhile (on a shared machine, the noise)."""
        out: dict[str, Any] = {}
        usage = self.usage(requests_per_s)
        for name, figures in usage.items():
            out[f"{name}_cpu_us_per_request"] = figures["cpu_us_per_request"]
            out[f"{name}_cores"] = figures["cores"]
        busy = (self._busy[1] - self._busy[0]) / self.seconds
        out["other_cores"] = busy - sum(figures["cores"] or 0.0 for figures in usage.values())
        return out


@dataclass
class RoleCpu(ProcessCpu):
    """An h2load probe over one server's processes, each by its role: its report is
    {role: {cores, cpu_us_per_request}}, so one sees how the connections spread over the front
    ends and what each door and engine costs a call."""

    def report(self, requests_per_s: float) -> dict[str, Any]:
        return self.usage(requests_per_s)


def tree_memory(pids: list[int]) -> dict[str, Any]:
    """Resident memory of the servers' processes, summed: RSS (shared pages counted once per
    process), PSS (shared pages split between their processes) and USS (private pages)."""
    total = {"processes": 0, "rss_mb": 0.0, "pss_mb": 0.0, "uss_mb": 0.0}
    by_process: dict[str, float] = {}
    for k, pid in enumerate(pids):
        for process in process_tree(pid):
            try:
                role = process_role(process)
                info = process.memory_full_info()
            except psutil.NoSuchProcess:
                continue
            total["processes"] += 1
            total["rss_mb"] += info.rss / MB
            total["pss_mb"] += getattr(info, "pss", math.nan) / MB
            total["uss_mb"] += info.uss / MB
            name = f"{role} of {k}" if len(pids) > 1 else role
            by_process[name] = info.rss / MB
    return {**total, "rss_mb_by_process": by_process}


def side_by_side(commands: Sequence[Sequence[str]]) -> list[dict[str, Any]]:
    """Run `python -m MODULE ARGS...` for each command at once, each in its own process so no
    measurement pays for another's threads; each prints its result as its last line of JSON."""
    processes = [
        subprocess.Popen([sys.executable, "-m", *command], stdout=subprocess.PIPE, text=True)
        for command in commands
    ]
    results = []
    for process in processes:
        out, _ = process.communicate()
        if process.returncode:
            raise RuntimeError(f"benchmark role failed with exit code {process.returncode}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results
