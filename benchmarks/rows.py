"""The rows of benchmarks/throughput.py: which server each row starts, how it is loaded, and
what is read from it. benchmarks/report.py prints what these return.

--load python (run_python): the server on MiniLM under the Python driver, unary and stream at
each C, and a mixed-length workload whose padded-token efficiency comes from /metrics.

--load h2load (run_h2load), by --only:
  - reference: in-process sentence-transformers (benchmarks/reference.py);
  - floor, floor-asyncio: a bare grpc.aio server that does no work, on uvloop and on asyncio's
    own loop (benchmarks/floor_server.py); loop-bound rows are held against the faster;
  - loop-bound: the server on the loop-bound model (benchmarks/loop_bound.py), one process,
    grpcio's door; loop-bound-node, -node-f1, -node-f2: the Node.js door in one process, in
    the default layout (--frontends 1) and with two front ends;
  - call-cpu-node, call-cpu-grpcio (the group call-cpu, with the floors): the loop-bound model
    in the default layout on each door, with the CPU of each process per call and the sum
    over the processes that serve calls (front ends and their doors: issue 36's target);
  - minilm, minilm-f1: the server on MiniLM in one process and in the default layout;
  - stand-in-f0/f1/f2: --frontends 0, 1, 2 in front of a stand-in device
    (benchmarks/stand_in.py), so the rate is what the front ends can answer;
  - memory: resident memory of --frontends N against N whole servers, N = 1, 2, on MiniLM.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks import loop_bound, processes, python_load, reference
from benchmarks.servers import (
    POOL_PATH,
    Target,
    _measure,
    _pool_request,
    start_floor,
    start_project_server,
    verify_pool,
)
from benchmarks.workload import _default_model_path, sentences

# The whole server in one process (the default is a supervisor, an engine process and one
# front end); a later --server-arg=--frontends=N overrides it.
SINGLE_PROCESS = ("--frontends", "0")
DEFAULT_LAYOUT = ("--frontends", "1")
NODE_DOOR = ("--grpc-door", "node")
GRPCIO_DOOR = ("--grpc-door", "grpcio")

# --- --load python ---------------------------------------------------------------------------


def _tokens(port: int) -> tuple[float, float]:
    """Real and padded tokens computed (a split server: summed over its engines already)."""
    from tests.metrics_endpoint import metric_sum, scrape

    scraped = scrape(port)
    return (
        metric_sum(scraped, "pooling_batch_real_tokens_total"),
        metric_sum(scraped, "pooling_batch_padded_tokens_total"),
    )


def run_python(args: argparse.Namespace) -> dict[str, Any]:
    """Unary and stream rows at each C, then the mixed-length row, against the reference."""
    from tests.server_process import free_port, start_server

    levels = [int(c) for c in (args.concurrency or "1,16,64,256").split(",")]
    model = args.model or str(_default_model_path())
    ref = reference.in_own_process(model)
    best = ref["best_sentences_per_s"]
    metrics_port = free_port()
    # The single-process server unless --server-arg says otherwise (--frontends=N).
    server = start_server(
        [
            *("--model", f"bench={model}", "--metrics-port", str(metrics_port)),
            *SINGLE_PROCESS,
            *args.server_arg,
        ],
        Path(tempfile.mkdtemp()),
    )
    procs = args.load_procs or (1 if (os.cpu_count() or 1) <= 4 else 4)
    rows = []
    try:
        seconds = str(args.duration)
        shared = ("--shared-channel",) if args.shared_channel else ()
        python_load.load(server.address, "unary", 16, "1.0", procs, *shared)  # warm up
        for mode in ("unary", "stream"):
            for c in levels:
                row = python_load.load(server.address, mode, c, seconds, min(procs, c), *shared)
                rows.append(
                    {"mode": mode, "concurrency": c, **row, "ratio": row["sentences_per_s"] / best}
                )
        real_before, padded_before = _tokens(metrics_port)
        mixed = python_load.load(server.address, "unary", 64, seconds, procs, "--mixed", *shared)
        real_after, padded_after = _tokens(metrics_port)
        rows.append(
            {
                "mode": "mixed-unary",
                "concurrency": 64,
                **mixed,
                "ratio": mixed["sentences_per_s"] / best,
            }
        )
    finally:
        server.stop()
    real, padded = real_after - real_before, padded_after - padded_before
    by_key = {(r["mode"], r["concurrency"]): r for r in rows}
    summary = {
        "cpus": os.cpu_count(),
        "load_procs": procs,
        **{f"reference_{k}": v for k, v in ref.items()},
        "c64_unary_ratio": by_key.get(("unary", 64), {}).get("ratio"),
        "c64_stream_ratio": by_key.get(("stream", 64), {}).get("ratio"),
        "c1_p50_over_batch1": (
            by_key[("unary", 1)]["p50_ms"] / ref["batch1_p50_ms"]
            if ("unary", 1) in by_key
            else None
        ),
        "mixed_padding_efficiency": real / padded if padded else None,
    }
    return {"summary": summary, "rows": rows, "reference": ref}


# --- --load h2load: which rows -------------------------------------------------------------

H2LOAD_ROWS = (
    "reference",
    "floor",
    "floor-asyncio",
    "loop-bound",
    "loop-bound-node",
    "loop-bound-node-f1",
    "loop-bound-node-f2",
    "call-cpu-node",
    "call-cpu-grpcio",
    "minilm",
    "minilm-f1",
    "stand-in-f0",
    "stand-in-f1",
    "stand-in-f2",
    "memory",
)
FLOOR_ROWS = ("floor", "floor-asyncio")
STAND_IN_ROWS = ("stand-in-f0", "stand-in-f1", "stand-in-f2")
NODE_ROWS = ("loop-bound-node", "loop-bound-node-f1", "loop-bound-node-f2")
# The loop-bound model in the default layout on each door, side by side: CPU per call over
# the processes that serve calls (issue 36), and the rate against the floor.
CALL_CPU_ROWS = {"call-cpu-node": "node", "call-cpu-grpcio": "grpcio"}
# --only also takes these names for several rows at once.
ROW_GROUPS = {
    # The floor on both loops (uvloop, as the server runs by default, and asyncio's own):
    # the loop-bound rows are measured against the faster of the two at each C.
    "floor": FLOOR_ROWS,
    "stand-in": STAND_IN_ROWS,
    "frontends": ("reference", "minilm", "minilm-f1", *STAND_IN_ROWS, "memory"),
    "call-cpu": (*FLOOR_ROWS, *CALL_CPU_ROWS),
}
NOT_BY_DEFAULT = ("minilm-f1", *STAND_IN_ROWS, "memory", *CALL_CPU_ROWS)
# Rows whose server is one process, which --profile can follow thread by thread.
PROFILE_ROWS = ("floor", "floor-asyncio", "loop-bound", "loop-bound-node", "minilm", "stand-in-f0")
# Rows whose server is split into processes: each one's CPU is read apart.
SPLIT_ROWS = (
    *("loop-bound-node-f1", "loop-bound-node-f2", "minilm-f1", "stand-in-f1", "stand-in-f2"),
    *CALL_CPU_ROWS,
)


def selected_rows(text: str | None) -> set[str]:
    if not text:
        return set(H2LOAD_ROWS) - set(NOT_BY_DEFAULT)
    only: set[str] = set()
    for name in text.split(","):
        only.update(ROW_GROUPS.get(name, (name,)))
    if unknown := only - set(H2LOAD_ROWS):
        raise SystemExit(
            f"--only: unknown rows {sorted(unknown)}; choose from {H2LOAD_ROWS} or the groups "
            f"{sorted(ROW_GROUPS)}"
        )
    return only


# --- --load h2load: one run ------------------------------------------------------------------


@dataclass
class H2loadRun:
    """What the rows of one run share: flags, the request, where servers write, the results."""

    args: argparse.Namespace
    work: Path
    model: str
    text: str
    body: bytes
    levels: list[int]
    stand_in_levels: list[int]
    rows: list[dict[str, Any]] = field(default_factory=list)
    profile: dict[str, Any] = field(default_factory=dict)
    loop_bound_model: str | None = None

    def levels_of(self, name: str) -> list[int]:
        return self.stand_in_levels if name in STAND_IN_ROWS else self.levels


def least_noisy(measure: Callable[[], dict[str, Any]], args: argparse.Namespace) -> dict:
    """Measure again (--retries times at most) while other work took more than
    --max-other-cores of the machine; keep the quietest attempt. A shared 2-core machine
    otherwise hands whichever row ran during someone's test suite half the CPU."""
    attempts = [measure()]
    while (
        args.max_other_cores is not None
        and attempts[-1]["other_cores"] > args.max_other_cores
        and len(attempts) <= args.retries
    ):
        attempts.append(measure())
    best = min(attempts, key=lambda a: a["other_cores"])
    best["attempts"] = len(attempts)
    return best


def model_dims(model: str) -> int:
    return int(json.loads((Path(model) / "config.json").read_text())["hidden_size"])


def start_minilm(run: H2loadRun, flags: list[str]) -> Target:
    model = run.model
    return start_project_server(
        "minilm", model, model_dims(model), [*flags, *run.args.server_arg], run.work
    )


def start_loop_bound(run: H2loadRun, flags: tuple[str, ...]) -> Target:
    if run.loop_bound_model is None:  # built once per run, in a process of its own
        built = processes.side_by_side([("benchmarks.loop_bound", str(run.work / "loop-bound"))])
        run.loop_bound_model = built[0]["folder"]
    return start_project_server(
        "loop-bound",
        run.loop_bound_model,
        loop_bound.HIDDEN,
        [*flags, *run.args.server_arg],
        run.work,
    )


def start_stand_in(run: H2loadRun, frontends: int) -> Target:
    from benchmarks import stand_in

    return start_project_server(
        "stand-in",
        run.model,
        model_dims(run.model),
        ["--frontends", str(frontends), "--max-batch-size", "256", *run.args.server_arg],
        run.work,
        module="benchmarks.stand_in",
        env={stand_in.ENV: str(run.args.stand_in_batch_ms)},
    )


def starters(run: H2loadRun) -> dict[str, Callable[[], Target]]:
    """Each server row's server, started on a free port and SERVING, in the rows' order."""
    floor_dims = run.args.floor_dims
    return {
        "floor": lambda: start_floor(floor_dims),
        "floor-asyncio": lambda: start_floor(floor_dims, "asyncio"),
        "loop-bound": partial(start_loop_bound, run, (*SINGLE_PROCESS, *GRPCIO_DOOR)),
        "loop-bound-node": partial(start_loop_bound, run, (*SINGLE_PROCESS, *NODE_DOOR)),
        "loop-bound-node-f1": partial(start_loop_bound, run, (*DEFAULT_LAYOUT, *NODE_DOOR)),
        "loop-bound-node-f2": partial(start_loop_bound, run, ("--frontends", "2", *NODE_DOOR)),
        **{
            name: partial(start_loop_bound, run, (*DEFAULT_LAYOUT, "--grpc-door", door))
            for name, door in CALL_CPU_ROWS.items()
        },
        "minilm": partial(start_minilm, run, list(SINGLE_PROCESS)),
        "minilm-f1": partial(start_minilm, run, list(DEFAULT_LAYOUT)),
        **{f"stand-in-f{n}": partial(start_stand_in, run, n) for n in (0, 1, 2)},
    }


def faster_floor(rows: list[dict[str, Any]], c: int) -> dict[str, Any] | None:
    floors = [r for r in rows if r["row"] in FLOOR_ROWS and r["concurrency"] == c]
    return max(floors, key=lambda r: r["requests_per_s"], default=None)


def serving_cpu(run: H2loadRun, name: str, row: dict[str, Any]) -> dict[str, Any]:
    """CPU per call and cores summed over the processes that serve calls (front ends and
    their doors, or a whole server), leaving out the supervisor and the engines; the rate
    over the faster floor at the same C (the floors run first), and the floor's CPU per call."""
    serving = [v for k, v in row["server_cores_by_process"].items() if processes.serves_calls(k)]
    floor = faster_floor(run.rows, row["concurrency"])
    return {
        "door": CALL_CPU_ROWS[name],
        "cpu_us_per_request": sum(v["cpu_us_per_request"] or 0.0 for v in serving),
        "cores": sum(v["cores"] for v in serving),
        "over_floor": row["requests_per_s"] / floor["requests_per_s"] if floor else None,
        "floor_cpu_us_per_request": floor["server_cpu_us_per_request"] if floor else None,
    }


def measure_level(run: H2loadRun, name: str, target: Target, c: int) -> None:
    """One h2load level against a started server; a split server's CPU read per process."""
    from benchmarks import cpu_profile

    args = run.args
    profiling = args.profile and name == args.profile_row and c == max(run.levels_of(name))
    threads = cpu_profile.ThreadCpu(target.pid) if profiling else None
    roles = processes.RoleCpu(roles_of=target.pid) if name in SPLIT_ROWS else None
    probes = [p for p in (threads, roles) if p is not None]
    row = least_noisy(partial(_measure, target, run.body, c, args, probes), args)
    reports = row.pop("probes")  # the quietest attempt's
    if roles:
        row["server_cores_by_process"] = reports[probes.index(roles)]
    row = {"row": name, **row}
    if name in CALL_CPU_ROWS:
        row["serving"] = serving_cpu(run, name, row)
    run.rows.append(row)
    if threads:
        run.profile.update(row=name, concurrency=c, threads=reports[probes.index(threads)])


def profile_functions(run: H2loadRun, name: str, target: Target) -> None:
    """py-spy over a run of its own: sampling slows the server, the rows stay clean."""
    from benchmarks import cpu_profile, h2load

    args = run.args
    spy = cpu_profile.PySpy(
        target.pid,
        run.work / f"py-spy-{name}.raw",
        seconds=max(1, int(args.duration - 2 * h2load.MARGIN_S)),
        rate_hz=args.profile_rate,
        native=args.profile_native,
        gil=args.profile_gil,
    )
    spy_threads = cpu_profile.ThreadCpu(target.pid)
    spied = _measure(target, run.body, max(run.levels_of(name)), args, [spy, spy_threads])
    run.profile["py_spy"], run.profile["py_spy_threads"] = spied.pop("probes")
    run.profile["py_spy_run"] = spied
    if not args.profile_gil:  # GIL samples are GIL time already
        cpu_profile.calibrate(run.profile["py_spy"], run.profile["py_spy_threads"])


def measure_server(run: H2loadRun, name: str, start: Callable[[], Target]) -> None:
    target = start()
    try:
        verify_pool(target, run.text)
        for c in run.levels_of(name):
            measure_level(run, name, target, c)
        if run.args.profile and name == run.args.profile_row:
            profile_functions(run, name, target)
    finally:
        target.stop()


def _load_briefly(target: Target, body: bytes, args: argparse.Namespace) -> None:
    """A short h2load run at C=64: the server's memory as it serves, not as it started."""
    from benchmarks import h2load

    h2load.run(
        f"http://{target.address}{POOL_PATH}",
        body,
        concurrency=64,
        duration_s=args.memory_load,
        warmup_s=0.5,
        max_connections=args.h2load_connections,
        work_dir=Path(args.work_dir),
    )


def measure_memory(
    start: Callable[[list[str]], Target], text: str, body: bytes, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """`--frontends N` against N whole single-process servers (`--frontends 0`, each on its
    own port), for N in 1, 2: resident memory over every process, once each has answered one
    call (idle) and after a short load on each (loaded)."""
    rows = []
    for n in (1, 2):
        for layout in ("split", "whole"):
            flags = ["--frontends", str(n)] if layout == "split" else list(SINGLE_PROCESS)
            targets: list[Target] = []
            try:
                for _ in range(1 if layout == "split" else n):
                    targets.append(start(flags))
                for target in targets:
                    verify_pool(target, text)
                idle = processes.tree_memory([t.pid for t in targets])
                for target in targets:
                    _load_briefly(target, body, args)
                loaded = processes.tree_memory([t.pid for t in targets])
            finally:
                for target in targets:
                    target.stop()
            server = f"--frontends {n}" if layout == "split" else f"{n} x --frontends 0"
            rows.append(
                {"server": server, "n": n, "layout": layout, "idle": idle, "loaded": loaded}
            )
    return rows


def ratios(
    run: H2loadRun, ref: dict[str, Any] | None, memory: list[dict[str, Any]]
) -> dict[str, float]:
    """The summary's ratios: loop-bound rows over the faster floor, MiniLM over the
    reference, split over whole, and the CPU per call of each door."""
    by = {(r["row"], r["concurrency"]): r for r in run.rows}
    out: dict[str, float] = {}

    def ratio(a: str, b: str, c: int) -> float | None:
        if (a, c) in by and (b, c) in by:
            return by[(a, c)]["requests_per_s"] / by[(b, c)]["requests_per_s"]
        return None

    for c in run.levels:
        floors = [by[(f, c)]["requests_per_s"] for f in FLOOR_ROWS if (f, c) in by]
        for name in ("loop-bound", *NODE_ROWS):
            if (name, c) in by and floors:
                key = name.replace("-", "_")
                out[f"{key}_over_floor_c{c}"] = by[(name, c)]["requests_per_s"] / max(floors)
        for name, key in (("minilm", "minilm"), ("minilm-f1", "minilm_f1")):
            if (name, c) in by and ref and c == max(run.levels):
                out[f"{key}_c{c}_over_in_process_best"] = (
                    by[(name, c)]["requests_per_s"] / ref["best_sentences_per_s"]
                )
        if (value := ratio("minilm-f1", "minilm", c)) is not None:
            out[f"minilm_f1_over_f0_c{c}"] = value
        for name, door in CALL_CPU_ROWS.items():
            if serving := by.get((name, c), {}).get("serving"):
                out[f"call_cpu_{door}_serving_us_c{c}"] = serving["cpu_us_per_request"]
                if serving["over_floor"] is not None:
                    out[f"call_cpu_{door}_over_floor_c{c}"] = serving["over_floor"]
    for name, key in (("minilm", "minilm"), ("minilm-f1", "minilm_f1")):
        if (name, 1) in by and ref:
            mean_ms = by[(name, 1)]["mean_ms"]
            out[f"{key}_c1_mean_over_batch1_mean"] = mean_ms / ref["batch1_mean_ms"]
    for c in run.stand_in_levels:
        for a, b in ((2, 1), (1, 0), (2, 0)):
            value = ratio(f"stand-in-f{a}", f"stand-in-f{b}", c)
            if value is not None:
                out[f"stand_in_f{a}_over_f{b}_c{c}"] = value
    for split, whole in zip(memory[::2], memory[1::2], strict=True):
        n = split["n"]
        for key in ("rss_mb", "pss_mb"):
            out[f"memory_f{n}_over_{n}x_f0_loaded_{key.removesuffix('_mb')}"] = (
                split["loaded"][key] / whole["loaded"][key]
            )
    return out


def run_h2load(args: argparse.Namespace, code: str) -> dict[str, Any]:
    """Every selected row, one server at a time, then the summary's ratios."""
    from benchmarks import h2load

    if not h2load.available():
        raise SystemExit("h2load not found: apt-get install nghttp2-client")
    only = selected_rows(args.only)
    if args.profile and args.profile_row not in only:
        only.add(args.profile_row)
    work = Path(tempfile.mkdtemp(prefix="h2load-bench-"))
    args.work_dir = str(work)
    text = sentences(1, seed=1)[0]
    run = H2loadRun(
        args=args,
        work=work,
        model=args.model or str(_default_model_path()),
        text=text,
        body=h2load.grpc_body(_pool_request(text)),
        levels=[int(c) for c in (args.concurrency or "64,1").split(",")],
        stand_in_levels=[int(c) for c in args.stand_in_concurrency.split(",")],
    )
    summary: dict[str, Any] = {
        "code": code,
        "cpus": os.cpu_count(),
        "loadavg_1m_before": os.getloadavg()[0],
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "max_connections": args.h2load_connections,
        "work_dir": str(work),
    }
    if only & set(STAND_IN_ROWS):
        summary["stand_in_batch_ms"] = args.stand_in_batch_ms
    ref = None
    if "reference" in only:
        ref = least_noisy(partial(reference.measure, run.model, args.wait_quiet), args)
        summary.update({f"reference_{k}": v for k, v in ref.items()})
    for name, start in starters(run).items():
        if name in only:
            measure_server(run, name, start)
    shutil.rmtree(work / "loop-bound", ignore_errors=True)
    memory = []
    if "memory" in only:
        memory = measure_memory(partial(start_minilm, run), text, run.body, args)
    summary.update(ratios(run, ref, memory))
    summary["loadavg_1m_after"] = os.getloadavg()[0]
    return {"summary": summary, "rows": run.rows, "memory": memory, "profile": run.profile}
