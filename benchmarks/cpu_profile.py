"""Where a server process's CPU goes per request, while h2load keeps it busy.

Two views, each divided by the requests answered in the same window:
  - per thread (psutil): CPU seconds of every thread, grouped by what the thread is (event
    loop, tokenize pool, forward workers, grpc's poller and core threads, other), so a change
    shows up in the thread that pays for it;
  - per function (py-spy sampling, collapsed stacks): self and inclusive samples, converted
    to microseconds per request, for project code (engine/, service/), grpc and asyncio.

Python 3.11 does not give its threads OS names, so Python thread names come from
`py-spy dump`; native threads (grpc core, torch) are named by their /proc comm.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

GROUPS = (
    "event loop",
    "tokenize",
    "forward",
    "torch intra-op",
    "grpc poller",
    "grpc core",
    "logging",
    "other",
)
# grpc core's own threads name themselves (comm, 15 characters at most).
_GRPC_COMMS = ("grpc", "event_engine", "lifeguard", "default-executo", "resolver-execut")


def py_spy() -> str | None:
    """py-spy next to this interpreter (the venv), else on PATH."""
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else shutil.which("py-spy")


def python_thread_names(pid: int) -> dict[int, str]:
    """OS thread id -> Python thread name, from one `py-spy dump` ({} without py-spy)."""
    binary = py_spy()
    if binary is None:
        return {}
    done = subprocess.run(
        [binary, "dump", "--json", "--pid", str(pid)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if done.returncode:
        return {}
    return {
        int(t["os_thread_id"]): t["thread_name"]
        for t in json.loads(done.stdout)
        if t.get("os_thread_id") is not None and t.get("thread_name")
    }


def thread_group(name: str) -> str:
    """The group of a thread, by its Python name or, for a native thread, its comm."""
    if name == "MainThread":
        return "event loop"
    if name.startswith("tokenize"):
        return "tokenize"
    if name.startswith("forward-"):
        return "forward"
    if "_poll_wrapper" in name:
        return "grpc poller"
    if "_monitor" in name:  # logging.handlers.QueueListener's thread
        return "logging"
    if name.startswith(_GRPC_COMMS):
        return "grpc core"
    if name == NATIVE_PYTHON_COMM:
        # No Python name and the comm it inherited: torch's OpenMP pool, started by a forward
        # worker running alone with every core (they spin a while after each pass).
        return "torch intra-op"
    return "other"


NATIVE_PYTHON_COMM = "python (native)"


def _comm(pid: int, tid: int) -> str:
    try:
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    except OSError:
        return "?"


@dataclass
class ThreadCpu:
    """Per-thread CPU seconds of one process over the window (an h2load probe)."""

    pid: int
    _before: dict[int, float] = field(default_factory=dict)
    _after: dict[int, float] = field(default_factory=dict)
    _names: dict[int, str] = field(default_factory=dict)
    _t: list[float] = field(default_factory=list)

    def _cpu(self) -> dict[int, float]:
        return {t.id: t.user_time + t.system_time for t in psutil.Process(self.pid).threads()}

    def start(self) -> None:
        self._t = [time.perf_counter()]
        self._before = self._cpu()

    def stop(self) -> None:
        self._after = self._cpu()
        self._t.append(time.perf_counter())
        # Named after the window: the tokenize pool starts its threads on first use.
        python = python_thread_names(self.pid)
        self._names = {tid: python.get(tid) or self._native(tid) for tid in self._after}

    def _native(self, tid: int) -> str:
        comm = _comm(self.pid, tid)
        return NATIVE_PYTHON_COMM if comm.startswith("python") else comm

    def report(self, requests_per_s: float) -> dict[str, Any]:
        seconds = self._t[1] - self._t[0]
        requests = requests_per_s * seconds
        threads = []
        for tid, cpu in self._after.items():
            used = cpu - self._before.get(tid, 0.0)  # a thread born in the window: all of it
            name = self._names.get(tid, "?")
            threads.append(
                {
                    "tid": tid,
                    "name": name,
                    "group": thread_group(name),
                    "cpu_s": used,
                    "us_per_request": 1e6 * used / requests if requests else None,
                }
            )
        groups: dict[str, dict[str, Any]] = {}
        for thread in threads:
            group = groups.setdefault(thread["group"], {"threads": 0, "cpu_s": 0.0, "names": set()})
            group["threads"] += 1
            group["cpu_s"] += thread["cpu_s"]
            group["names"].add(re.sub(r"\d+", "N", thread["name"]))
        for group in groups.values():
            group["names"] = sorted(group["names"])
            group["cores"] = group["cpu_s"] / seconds
            group["us_per_request"] = 1e6 * group["cpu_s"] / requests if requests else None
        total = sum(t["cpu_s"] for t in threads)
        return {
            "kind": "threads",
            "window_s": seconds,
            "requests": requests,
            "requests_per_s": requests_per_s,
            "total_us_per_request": 1e6 * total / requests if requests else None,
            "total_cores": total / seconds,
            "groups": dict(sorted(groups.items(), key=lambda kv: -kv[1]["cpu_s"])),
            "threads": sorted(threads, key=lambda t: -t["cpu_s"]),
        }


@dataclass
class PySpy:
    """`py-spy record` over the window into a raw (collapsed stacks) file (an h2load probe).

    Non-native and non-blocking by default: the server keeps running while sampled, so the
    run's rate stays close to an unprofiled one. --native pauses the process for each sample
    (slower) but shows time inside Cython and C; grpc's Cython module has no symbols, so its
    frames fold into one `[native] (cygrpc...)` entry. --gil samples only the thread that
    holds the GIL, so its figures are GIL time per request: what bounds a server that is
    GIL-bound, whatever its cores.
    """

    pid: int
    out: Path
    seconds: int
    rate_hz: int = 250
    native: bool = False
    gil: bool = False
    _process: subprocess.Popen[str] | None = None
    _log: str = ""

    def start(self) -> None:
        binary = py_spy()
        if binary is None:
            raise RuntimeError("py-spy is not installed: pip install py-spy")
        command = [
            binary,
            "record",
            "--threads",
            "--nolineno",
            f"--rate={self.rate_hz}",
            "--format=raw",
            f"--output={self.out}",
            f"--pid={self.pid}",
            f"--duration={self.seconds}",
        ]
        command.append("--native" if self.native else "--nonblocking")
        if self.gil:
            command.append("--gil")
        self._process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )

    def stop(self) -> None:
        assert self._process is not None
        self._log, _ = self._process.communicate(timeout=self.seconds + 60)
        if self._process.returncode or not self.out.exists():
            raise RuntimeError(f"py-spy failed ({self._process.returncode}):\n{self._log}")

    def report(self, requests_per_s: float) -> dict[str, Any]:
        requests = requests_per_s * self.seconds
        return {
            "kind": "py-spy",
            "raw_file": str(self.out),
            "rate_hz": self.rate_hz,
            "native": self.native,
            "gil": self.gil,
            "seconds": self.seconds,
            "requests": requests,
            "requests_per_s": requests_per_s,
            "py_spy_log": self._log.strip().splitlines()[-2:],
            **aggregate(self.out, self.rate_hz, requests),
        }


_NATIVE = re.compile(r"^0x[0-9a-fA-F]+ \((?P<lib>[^)]*)\)$")
_THREAD = re.compile(r"^thread \((?P<tid>\w+)\)(?:: (?P<name>.*))?$")


def _frame(frame: str) -> str:
    """An unsymbolised native frame folds into its library."""
    native = _NATIVE.match(frame)
    return f"[native] ({Path(native.group('lib')).name})" if native else frame


def frame_area(frame: str) -> str | None:
    """project, grpc or asyncio by the frame's (short) file name; None for anything else."""
    match = re.search(r"\(([^)]*)\)$", frame)
    path = match.group(1) if match else ""
    if path.startswith(("engine/", "service/")):
        return "project"
    if "grpc" in path:
        return "grpc"
    if path.startswith("asyncio/") or "_asynciomodule" in path:
        return "asyncio"
    return None


def aggregate(raw_file: Path, rate_hz: int, requests: float, top: int = 15) -> dict[str, Any]:
    """Self and inclusive samples per function from py-spy's raw output, in us per request.

    A sample of an active thread stands for 1/rate seconds of that thread's time.
    """
    scale = 1e6 / rate_hz / requests if requests else 0.0
    self_samples: Counter[tuple[str, str]] = Counter()
    inclusive: Counter[tuple[str, str]] = Counter()
    by_group: Counter[str] = Counter()
    total = 0
    for line in raw_file.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        thread = _THREAD.match(frames[0])
        name = "?"
        if thread:
            name = thread.group("name") or thread.group("tid")
            frames = frames[1:]
        group = thread_group(name)
        frames = [_frame(f) for f in frames]
        total += count
        by_group[group] += count
        if frames:
            self_samples[(group, frames[-1])] += count
        for frame in set(frames):
            inclusive[(group, frame)] += count

    def rows(items: list[tuple[Any, int]]) -> list[dict[str, Any]]:
        return [{"key": key, "samples": n, "us_per_request": n * scale} for key, n in items]

    areas = {
        area: rows(
            sorted(
                (
                    (key, n)
                    for key, n in inclusive.items()
                    # A thread's root frames (in nearly all its samples) say nothing.
                    if frame_area(key[1]) == area and n < 0.98 * by_group[key[0]]
                ),
                key=lambda kv: -kv[1],
            )[:top]
        )
        for area in ("project", "grpc", "asyncio")
    }
    return {
        "samples": total,
        "us_per_request": total * scale,
        "by_group": {g: {"samples": n, "us_per_request": n * scale} for g, n in by_group.items()},
        "self_top": rows(self_samples.most_common(top)),
        "inclusive_top": areas,
    }


def calibrate(spy: dict[str, Any], threads: dict[str, Any]) -> None:
    """Scale py-spy's figures, per thread group, to the CPU psutil measured in the same run.

    py-spy counts a sample whenever a thread is not known to be idle; on a saturated machine a
    thread that is runnable but waiting for a core (or just woken in select or a wait) counts
    too, so raw samples overstate CPU. The share of each function within its thread is kept;
    the thread group's total becomes what the kernel says it used.
    """
    factors = {}
    for group, sampled in spy["by_group"].items():
        measured = threads["groups"].get(group, {}).get("us_per_request")
        if measured is not None and sampled["us_per_request"]:
            factors[group] = measured / sampled["us_per_request"]
            sampled["cpu_us_per_request"] = measured
    spy["cpu_scale_by_group"] = factors
    for rows in (spy["self_top"], *spy["inclusive_top"].values()):
        for row in rows:
            factor = factors.get(row["key"][0])
            row["cpu_us_per_request"] = row["us_per_request"] * factor if factor else None


def format_report(threads: dict[str, Any] | None, spy: dict[str, Any] | None) -> str:
    """The compact text tables of one profile."""
    lines: list[str] = []
    if threads:
        lines.append(
            f"CPU per request by thread (psutil, {threads['window_s']:.1f} s at "
            f"{threads['requests_per_s']:.0f} req/s): total {threads['total_us_per_request']:.0f}"
            f" us/request, {threads['total_cores']:.2f} cores"
        )
        lines.append(f"  {'group':<12}{'threads':>8}{'us/req':>9}{'cores':>7}  names")
        for group, g in threads["groups"].items():
            lines.append(
                f"  {group:<12}{g['threads']:>8}{g['us_per_request']:>9.1f}{g['cores']:>7.2f}"
                f"  {', '.join(g['names'])}"
            )
    if spy and spy.get("gil"):
        held = spy["samples"] / (spy["rate_hz"] * spy["seconds"])
        groups = ", ".join(f"{g} {v['us_per_request']:.0f}" for g, v in spy["by_group"].items())
        lines.append(
            f"py-spy --gil ({spy['rate_hz']} Hz, {spy['seconds']} s at "
            f"{spy['requests_per_s']:.0f} req/s): the GIL was held {held:.0%} of the window, "
            f"{spy['us_per_request']:.0f} us a request; by thread: {groups}"
        )
    elif spy:
        groups = ", ".join(
            f"{g} {v['us_per_request']:.0f}->{v.get('cpu_us_per_request', math.nan):.0f}"
            for g, v in spy["by_group"].items()
        )
        lines.append(
            f"py-spy ({'native' if spy['native'] else 'non-blocking'}, {spy['rate_hz']} Hz, "
            f"{spy['seconds']} s at {spy['requests_per_s']:.0f} req/s), us/request sampled -> "
            f"scaled to the thread group's psutil CPU in that run: {groups}"
        )
    if spy:
        gil = bool(spy.get("gil"))

        def table(title: str, rows: list[dict[str, Any]]) -> None:
            lines.append(f"  {title}")
            head = "GIL us" if gil else "cpu us"
            lines.append(f"  {head:>7}{'sampled':>8}  {'thread':<12}function (file)")
            for row in rows:
                group, frame = row["key"]
                cpu = row["us_per_request"] if gil else row.get("cpu_us_per_request")
                lines.append(
                    f"  {cpu if cpu is not None else math.nan:>7.1f}{row['us_per_request']:>8.1f}"
                    f"  {group:<12}{frame}"
                )

        table("self time, top functions:", spy["self_top"])
        for area, rows in spy["inclusive_top"].items():
            if rows:
                table(f"inclusive time, {area}:", rows)
        lines.append(f"  raw stacks: {spy['raw_file']}")
    return "\n".join(lines)
