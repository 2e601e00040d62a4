"""What benchmarks/throughput.py prints: the rows' figures as tables, the ratios the targets
are stated in, and which code was measured, so a result file says what it is."""

from __future__ import annotations

import math
import subprocess
from pathlib import Path
from typing import Any

from benchmarks import processes


def code_version() -> str:
    """The commit measured (and whether the tree had changes), so results say what they are."""
    git = ["git", "-C", str(Path(__file__).resolve().parent.parent)]
    try:
        commit = subprocess.run(
            [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--", "engine", "service"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + (" + uncommitted changes in engine/ or service/" if dirty else "")


def _summary_lines(summary: dict[str, Any], skip_reference: bool) -> list[str]:
    return [
        f"{key}: {value:.3f}" if isinstance(value, float) else f"{key}: {value}"
        for key, value in summary.items()
        if not (skip_reference and key.startswith("reference_"))
    ]


def format_python(result: dict[str, Any]) -> str:
    """--load python: the reference, then a line per mode and C, then the summary."""
    reference, summary = result["reference"], result["summary"]
    lines = [
        f"in-process sentence-transformers on {reference['device']}/{reference['dtype']}: "
        f"best {reference['best_sentences_per_s']:.1f}/s at batch "
        f"{reference['best_batch']}; batch 1 {reference['batch1_sentences_per_s']:.1f}/s, "
        f"p50 {reference['batch1_p50_ms']:.2f} ms",
        f"{'mode':<12}{'C':>5}{'sent/s':>10}{'p50 ms':>10}{'p99 ms':>10}{'x best':>9}",
    ]
    for r in result["rows"]:
        lines.append(
            f"{r['mode']:<12}{r['concurrency']:>5}{r['sentences_per_s']:>10.1f}"
            f"{r['p50_ms']:>10.2f}{r['p99_ms']:>10.2f}{r['ratio']:>9.2f}"
        )
    return "\n".join([*lines, *_summary_lines(summary, skip_reference=False)])


def format_memory(memory: list[dict[str, Any]]) -> list[str]:
    lines = [
        "memory (MB over every process of the server(s); idle: after one call; loaded: after "
        "a short C=64 h2load run on each):",
        f"{'server':<22}{'procs':>6}{'RSS idle':>10}{'RSS loaded':>12}{'PSS loaded':>12}"
        f"{'USS loaded':>12}  RSS loaded by process",
    ]
    for m in memory:
        idle, loaded = m["idle"], m["loaded"]
        parts = ", ".join(f"{k} {v:.0f}" for k, v in loaded["rss_mb_by_process"].items())
        lines.append(
            f"{m['server']:<22}{loaded['processes']:>6}{idle['rss_mb']:>10.0f}"
            f"{loaded['rss_mb']:>12.0f}{loaded['pss_mb']:>12.0f}{loaded['uss_mb']:>12.0f}"
            f"  {parts}"
        )
    return lines


def _nan(value: float | None) -> float:
    return math.nan if value is None else value


def format_call_cpu(rows: list[dict[str, Any]]) -> list[str]:
    """The call-cpu rows side by side: per door and C, the rate and its ratio to the faster
    floor, and CPU per call of each process, summed over those that serve calls."""
    door_rows = [r for r in rows if "serving" in r]
    if not door_rows:
        return []
    lines = [
        "CPU per unary one-text call, loop-bound model, default layout (--frontends 1); "
        "serving = front ends and their doors, summed (not the supervisor or the engine):",
        f"{'door':<8}{'C':>4}{'calls/s':>9}{'x floor':>8}{'serving us':>11}{'cores':>7}"
        f"{'floor us':>9}  us per call by process",
    ]
    for r in door_rows:
        serving = r["serving"]
        by_process = sorted(
            r["server_cores_by_process"].items(), key=lambda kv: not processes.serves_calls(kv[0])
        )
        parts = ", ".join(f"{name} {v['cpu_us_per_request'] or 0:.0f}" for name, v in by_process)
        lines.append(
            f"{serving['door']:<8}{r['concurrency']:>4}{r['requests_per_s']:>9.1f}"
            f"{_nan(serving['over_floor']):>8.2f}{serving['cpu_us_per_request']:>11.0f}"
            f"{serving['cores']:>7.2f}{_nan(serving['floor_cpu_us_per_request']):>9.0f}  {parts}"
        )
    lines.append(
        "x floor: calls/s over the faster floor at that C; floor us: the floor's CPU per call"
    )
    return lines


def format_h2load(result: dict[str, Any]) -> str:
    from benchmarks import cpu_profile

    summary, lines = result["summary"], []
    if "reference_best_sentences_per_s" in summary:
        lines.append(
            f"in-process sentence-transformers on {summary['reference_device']}/"
            f"{summary['reference_dtype']}: best {summary['reference_best_sentences_per_s']:.1f}/s"
            f" at batch {summary['reference_best_batch']}; batch 1 mean "
            f"{summary['reference_batch1_mean_ms']:.2f} ms, p50 "
            f"{summary['reference_batch1_p50_ms']:.2f} ms"
        )
    lines.append(
        f"{'row':<12}{'C':>4}{'conn':>6}{'req/s':>9}{'mean ms':>9}{'p50 ms':>8}{'p99 ms':>8}"
        f"{'ok/fail/err':>16}{'srv us/req':>11}{'srv cores':>10}{'h2l us/req':>11}"
        f"{'others':>7}"
    )
    for r in result["rows"]:
        status = f"{r['succeeded']}/{r['failed']}/{r['errored']}"
        lines.append(
            f"{r['row']:<12}{r['concurrency']:>4}"
            f"{str(r['connections']) + 'x' + str(r['streams_per_connection']):>6}"
            f"{r['requests_per_s']:>9.1f}{r['mean_ms']:>9.2f}{r.get('p50_ms', math.nan):>8.2f}"
            f"{r.get('p99_ms', math.nan):>8.2f}"
            f"{status:>16}"
            f"{r['server_cpu_us_per_request']:>11.0f}{r['server_cores']:>10.2f}"
            f"{r['h2load_cpu_us_per_request']:>11.0f}{r['other_cores']:>7.2f}"
        )
    lines.append(
        "conn: connections x streams each; ok/fail/err: h2load's succeeded/failed/errored (HTTP "
        "level); srv/h2l us/req: CPU of the server / h2load per request; others: cores the rest "
        "of the machine used meanwhile (noise)"
    )
    for r in result["rows"]:
        if by_process := r.get("server_cores_by_process"):
            parts = ", ".join(
                f"{k} {v['cores']:.2f} ({v['cpu_us_per_request'] or 0:.0f} us/req)"
                for k, v in by_process.items()
            )
            lines.append(f"{r['row']} C={r['concurrency']} server cores by process: {parts}")
    lines.extend(format_call_cpu(result["rows"]))
    if result.get("memory"):
        lines.extend(format_memory(result["memory"]))
    for r in result["rows"]:
        codes = r.get("server_calls_by_code", {})
        # h2load ends its run with streams in flight: up to C calls end CANCELLED.
        bad = {k: v for k, v in codes.items() if k not in ("OK", "CANCELLED")}
        if codes.get("CANCELLED", 0) > r["concurrency"]:
            bad["CANCELLED"] = codes["CANCELLED"]
        if bad:
            lines.append(f"WARNING {r['row']}: the server answered non-OK codes {bad}")
    lines.extend(_summary_lines(summary, skip_reference=True))
    if result["profile"]:
        p = result["profile"]
        lines.append(f"profile of {p.get('row')} at C={p.get('concurrency')}:")
        if "py_spy_run" in p:
            lines.append(
                f"(the py-spy run: {p['py_spy_run']['requests_per_s']:.1f} req/s, "
                f"server {p['py_spy_run']['server_cpu_us_per_request']:.0f} us/request)"
            )
        lines.append(cpu_profile.format_report(p.get("threads"), p.get("py_spy")))
    return "\n".join(lines)
