"""The engine process's own cost per item: one engine, fed by driver processes, no front end.

Issue 35 asks how many items one engine process can batch and answer per second in front of
a fast device, and what each costs it in CPU. Here nothing else stands in the way: no gRPC,
no tokenizer, no front end. One engine process runs through the device stand-in
(benchmarks/stand_in.py: a fixed wait per batch, --batch-ms, 0.5 ms by default, for up to
--max-batch-size items) on the MiniLM folder shipped in the venv; each driver process is a
front end in all but name (its own Link, origin = its index) that keeps --in-flight one-text
jobs of about 20 pre-tokenized ids outstanding, sent as `Submit` messages of up to
--jobs-per-message jobs that were encoded once and are re-sent as soon as all their jobs are
answered. It counts the items answered over --seconds after a warm-up, and reads the engine's
CPU time (user + system, psutil) over the same window, so CPU per item is the engine's
whole cost per item: decoding, queueing, batch forming, collating, the results message.

Run: python -m benchmarks.engine_alone [--seconds 10] [--driver-links 1] [--batch-ms 0.5]
     [--max-batch-size 256] [--profile out.txt] [--label before]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path
from typing import Any

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MODEL = "minilm"
READY_TIMEOUT_S = 180.0


def _messages(
    origin: int, in_flight: int, per_message: int, clients: int, seed: int
) -> list[tuple[bytes, bytes]]:
    """Every message a driver sends, encoded once: job ids k*per_message.. in message k.

    Lengths are 18..22 ids (about 20), so batches are formed by length closeness as for
    real texts, yet every batch is full under either padding rule (--min-padding-efficiency
    0.9, the default since fcdc959, or the 0.8 before it): a batch's size does not depend on
    the version measured. `clients` names cycle over the jobs (each its own queue in the
    engine).
    """
    from pooling_server.engine.scheduling.ipc import IDS, JobHeader, Submit, encoder

    rng = random.Random(seed)
    messages = []
    for k in range(in_flight // per_message):
        headers, ids = [], []
        for j in range(per_message):
            n = rng.randint(18, 22)
            ids += [101, *(rng.randrange(1000, 30000) for _ in range(n - 2)), 102]
            key = k * per_message + j
            client = f"client-{key % clients}" if clients > 1 else ""
            headers.append(JobHeader(key, MODEL, None, False, [n], client))
        header = encoder.encode(Submit(origin, False, headers))
        messages.append((header, np.array(ids, dtype=IDS).tobytes()))
    return messages


def _drive(
    address: str,
    origin: int,
    args: argparse.Namespace,
    items: Synchronized[int],
    errors: Synchronized[int],
    messages_in: Synchronized[int],
) -> None:
    """A driver process: keep every message's jobs outstanding; count the items answered."""
    import msgspec

    from pooling_server.engine.scheduling.ipc import Link, Results

    results_decoder = msgspec.msgpack.Decoder(Results)

    per_message = args.jobs_per_message
    messages = _messages(origin, args.in_flight, per_message, args.clients, seed=origin)
    remaining = [per_message] * len(messages)
    link = Link.connect(address)
    for header, payload in messages:
        link.send(header, [payload])
    while (message := link.read()) is not None:
        results = results_decoder.decode(message[0]).results
        failed = 0
        for result in results:
            failed += result.error is not None
            k = result.id // per_message
            remaining[k] -= 1
            if not remaining[k]:
                remaining[k] = per_message
                header, payload = messages[k]
                link.send(header, [payload])
        with items.get_lock():
            items.value += len(results) - failed
            messages_in.value += 1
        if failed:
            with errors.get_lock():
                errors.value += failed


def _start_engine(run_dir: str, args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], int]:
    """The engine process through the stand-in; returns it and the write end of its stop pipe."""
    from benchmarks.workload import _default_model_path

    stop_read, stop_write = os.pipe()
    os.makedirs(f"{run_dir}/metrics")
    env = dict(os.environ, POOLING_STAND_IN_BATCH_MS=str(args.batch_ms))
    env["PROMETHEUS_MULTIPROC_DIR"] = f"{run_dir}/metrics"
    command = [sys.executable, "-m", "benchmarks.engine_alone", "engine", "--model"]
    command += [f"{MODEL}={_default_model_path()}", "--max-batch-size", str(args.max_batch_size)]
    command += ["--role", "engine", "--role-index", "0", "--run-dir", run_dir]
    command += ["--stop-fd", str(stop_read), *shlex.split(args.server_args)]
    with open(f"{run_dir}/engine.log", "wb") as log:
        engine = subprocess.Popen(
            command, pass_fds=(stop_read,), env=env, cwd=ROOT, stdout=log, stderr=log
        )
    os.close(stop_read)
    return engine, stop_write


def _wait_ready(run_dir: str, engine: subprocess.Popen[bytes]) -> None:
    from pooling_server.service.split.run_dir import is_ready

    deadline = time.monotonic() + READY_TIMEOUT_S
    while not is_ready(run_dir, 0):
        if engine.poll() is not None or time.monotonic() > deadline:
            log = Path(run_dir, "engine.log").read_text(errors="replace")
            raise SystemExit(f"the engine did not get ready:\n{log[-4000:]}")
        time.sleep(0.1)


def _profile(pid: int, seconds: float, out: str) -> subprocess.Popen[bytes]:
    from benchmarks.cpu_profile import py_spy

    binary = py_spy()
    if binary is None:
        raise SystemExit("--profile needs py-spy (pip install py-spy)")
    command = [binary, "record", "--threads", "--gil", "--format", "raw", "--nonblocking"]
    command += ["--rate", "500"]
    command += ["-p", str(pid), "-d", str(max(1, round(seconds))), "-o", out]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL)


def _thread_cpu(process: psutil.Process) -> dict[int, float]:
    """CPU seconds of each of the process's threads, by OS thread id."""
    return {t.id: t.user_time + t.system_time for t in process.threads()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.cpu_profile import python_thread_names
    from pooling_server.service.split.run_dir import engine_address

    run_dir = tempfile.mkdtemp(prefix="engine-alone-")
    engine, stop_write = _start_engine(run_dir, args)
    context = multiprocessing.get_context("spawn")
    items, errors, answers = (context.Value("q", 0) for _ in range(3))
    drivers = []
    try:
        _wait_ready(run_dir, engine)
        for origin in range(args.driver_links):
            target_args = (engine_address(run_dir, 0), origin, args, items, errors, answers)
            drivers.append(context.Process(target=_drive, args=target_args, daemon=True))
            drivers[-1].start()
        time.sleep(args.warm_up)
        process = psutil.Process(engine.pid)
        names = python_thread_names(engine.pid)
        profiler = _profile(engine.pid, args.seconds, args.profile) if args.profile else None
        threads0 = _thread_cpu(process)
        cpu0, items0, t0 = process.cpu_times(), items.value, time.monotonic()
        answers0 = answers.value
        time.sleep(args.seconds)
        cpu1, items1, t1 = process.cpu_times(), items.value, time.monotonic()
        answers1 = answers.value
        threads1 = _thread_cpu(process)
        if profiler is not None:
            profiler.wait(timeout=120)
        if not all(driver.is_alive() for driver in drivers):
            raise SystemExit("a driver process died")
    finally:
        for driver in drivers:
            driver.kill()
        os.close(stop_write)  # the engine stops once its stop pipe reads end-of-file
        try:
            engine.wait(60)
        except subprocess.TimeoutExpired:
            engine.kill()
        shutil.rmtree(run_dir, ignore_errors=True)
    count = items1 - items0
    cpu = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
    by_thread: dict[str, float] = {}
    for tid, seconds in threads1.items():
        name = names.get(tid, "native")
        spent = seconds - threads0.get(tid, 0.0)
        by_thread[name] = by_thread.get(name, 0.0) + 1e6 * spent / max(count, 1)
    return {
        "label": args.label,
        "items_per_s": round(count / (t1 - t0)),
        "engine_cpu_us_per_item": round(1e6 * cpu / max(count, 1), 2),
        "engine_cpu_cores": round(cpu / (t1 - t0), 2),
        "engine_system_us_per_item": round(1e6 * (cpu1.system - cpu0.system) / max(count, 1), 2),
        "engine_us_per_item_by_thread": {k: round(v, 2) for k, v in sorted(by_thread.items())},
        "items": count,
        "items_per_results_message": round(count / max(answers1 - answers0, 1), 1),
        "errors": errors.value,
        "seconds": round(t1 - t0, 2),
        "driver_links": args.driver_links,
        "clients": args.clients,
        "in_flight_per_link": args.in_flight,
        "jobs_per_message": args.jobs_per_message,
        "batch_ms": args.batch_ms,
        "max_batch_size": args.max_batch_size,
        "server_args": args.server_args,
        "cores": os.cpu_count(),
        "commit": _commit(),
    }


def _commit() -> str:
    done = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    )
    return done.stdout.strip()


def _engine(argv: list[str]) -> int:
    """The engine process: the stand-in's, its patch adapted to `_forward`'s signature (the
    stand-in's takes no `threads`, which ModelRunner.forward now passes)."""
    import inspect

    from benchmarks import stand_in
    from pooling_server.engine.models.model_runner import ModelRunner
    from pooling_server.service.launch import main as serve

    stand_in.install(stand_in.batch_seconds())
    patched = ModelRunner._forward
    if len(inspect.signature(patched).parameters) == 3:  # self, batch, keep_tokens

        def _forward(self: ModelRunner, batch: Any, keep_tokens: Any, *_: object) -> Any:
            return patched(self, batch, keep_tokens)

        ModelRunner._forward = _forward  # type: ignore[method-assign]
    return serve(argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["engine"]:
        return _engine(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="the measured window")
    parser.add_argument("--warm-up", type=float, default=2.0, help="seconds before measuring")
    parser.add_argument("--driver-links", type=int, default=1, help="driver processes")
    parser.add_argument("--clients", type=int, default=1, help="client names per driver")
    parser.add_argument("--in-flight", type=int, default=4096, help="jobs outstanding a link")
    parser.add_argument("--jobs-per-message", type=int, default=64)
    parser.add_argument("--batch-ms", type=float, default=0.5, help="the stand-in's wait")
    parser.add_argument("--max-batch-size", type=int, default=256)
    parser.add_argument("--server-args", default="", help="more engine flags (one string)")
    parser.add_argument("--profile", help="py-spy raw output of the engine over the window")
    parser.add_argument("--label", help="write benchmarks/results/engine-alone-2core-LABEL.json")
    parser.add_argument("--runs", type=int, default=1, help="repeat; the JSON keeps every run")
    args = parser.parse_args(argv)
    if args.in_flight % args.jobs_per_message:
        parser.error("--in-flight must be a multiple of --jobs-per-message")
    rows = []
    for _ in range(args.runs):
        row = run(args)
        rows.append(row)
        print(
            f"{row['items_per_s']:,} items/s, {row['engine_cpu_us_per_item']} us of engine CPU "
            f"an item ({row['engine_cpu_cores']} cores), {row['errors']} errors"
        )
        print(json.dumps(row))
    if args.label:
        RESULTS.mkdir(exist_ok=True)
        path = RESULTS / f"engine-alone-2core-{args.label}.json"
        rates = sorted(row["items_per_s"] for row in rows)
        summary = {"min_items_per_s": rates[0], "median_items_per_s": rates[len(rates) // 2]}
        path.write_text(json.dumps({**summary, "runs": rows}, indent=1) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
