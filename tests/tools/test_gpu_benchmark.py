"""benchmarks/gpu.py's pure parts: a GPU run is prepared on a machine without a GPU, so what
can be checked here (the requirement report, row selection, ratios, the Markdown, the
nvidia-smi sampler against a stand-in) is checked before the minutes on a GPU are spent."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from benchmarks import gpu


def test_unmet_names_missing_and_too_old_packages_only() -> None:
    installed = {r.distribution: "99.0" for r in gpu.REQUIREMENTS}
    assert gpu.unmet(installed) == []
    installed |= {"grpcio": "1.62.0", "msgspec": None, "protobuf": "7.36.2+local"}
    assert gpu.unmet(installed) == [
        "grpcio: 1.62.0 is older than 1.85.1",
        "msgspec: missing",
    ]


def test_requirements_report_says_what_is_missing_and_the_fallbacks() -> None:
    installed = {r.distribution: "99.0" for r in gpu.REQUIREMENTS} | {"grpcio-status": None}
    report = gpu.requirements_report(installed, {"h2load": None, "node": "/usr/bin/node"})
    assert "NOT MET grpcio-status: missing" in report
    assert "h2load: not on PATH (Python grpc.aio load instead)" in report
    assert "node: /usr/bin/node" in report
    assert "torch" not in report.splitlines()[0].split(":", 1)[1]  # expected there already


def test_select_rows_takes_globs_and_prefixes() -> None:
    rows = gpu.plan_rows()
    assert [r.name for r in gpu.select_rows(rows, "minilm/default")] == [
        f"minilm/default/{w}" for w in gpu.ALL
    ]
    picked = gpu.select_rows(rows, "*/graphs-off/c1, base/default/c256")
    assert {r.name for r in picked} == {
        "minilm/graphs-off/c1",
        "base/graphs-off/c1",
        "base/default/c256",
    }
    assert [r.name for r in picked] == [r.name for r in rows if r in picked]  # plan order
    with pytest.raises(SystemExit):
        gpu.select_rows(rows, "nope")


def _row(server: str, workload: str, texts_per_s: float, **extra: object) -> dict:
    spec = gpu.WORKLOADS[workload]
    return {
        "row": f"minilm/{server}/{workload}",
        "shape": "minilm",
        "server": server,
        "workload": workload,
        "texts_per_call": spec.texts_per_call,
        "concurrency": spec.concurrency,
        "load": "h2load",
        "texts_per_s": texts_per_s,
        "mean_ms": 2.0,
        "p99_ms": 5.0,
        "gpu_busy_pct": 55.0,
        "gpu_mem_mib": 1234.0,
        "padding_efficiency": 0.9,
        "mean_batch_size": 12.5,
        "failed_calls": 0,
        "cores_by_role": {"engine": 1.0, "frontend": 0.5, "node": 0.25, "supervisor": 0.0},
        **extra,
    }


def test_ratios_against_the_reference_and_the_default_server() -> None:
    reference = {"best_texts_per_s": 1000.0, "mixed_texts_per_s": 200.0, "batch1_mean_ms": 4.0}
    rows = [
        _row("default", "c1", 100.0),
        _row("default", "mixed32-c64", 100.0),
        _row("graphs-off", "c1", 50.0),
        {"row": "minilm/engines-2/c256", "server": "engines-2", "error": "boom"},
    ]
    for row in rows[:3]:
        gpu.add_ratios(row, reference)
    gpu.add_default_ratios(rows)
    assert rows[0]["x_reference"] == pytest.approx(0.1)
    assert rows[0]["latency_x_reference"] == pytest.approx(0.5)
    assert rows[1]["x_reference"] == pytest.approx(0.5)  # mixed: over the mixed reference
    assert "latency_x_reference" not in rows[1]
    assert rows[2]["x_default"] == pytest.approx(0.5)
    assert "x_default" not in rows[0] and "x_default" not in rows[3]


def test_markdown_has_every_row_failed_ones_with_their_error() -> None:
    result = {
        "meta": {"device_name": "NVIDIA H200", "date": "2026-12-04", "load": "h2load"},
        "references": {
            "minilm": {
                "shape": {"layers": 6, "hidden": 384},
                "device": "cuda",
                "dtype": "bfloat16",
                "best_texts_per_s": 10000.0,
                "best_batch": 256,
                "batch1_mean_ms": 4.0,
                "mixed_texts_per_s": 2000.0,
            },
            "base": {"error": "skipped: time budget"},
        },
        "servers": [
            {
                "shape": "minilm",
                "server": "default",
                "flags": [],
                "processes": {"engine": 2, "frontend": 1},
                "grpc_door": "node",
                "start_s": 12.0,
                "parity_min_cosine": 0.99991,
            },
            {
                "shape": "minilm",
                "server": "engines-2",
                "flags": ["--engines-per-device", "2"],
                "error": "usage: ...\nerror: unrecognized arguments: --engines-per-device 2",
            },
        ],
        "rows": [
            _row("default", "c1", 250.0, x_reference=0.025, latency_x_reference=1.2),
            {"row": "minilm/default/c256", "error": "h2load exited with 1:\nconnect failed"},
        ],
        "notes": ["base/default: skipped, over the time budget"],
    }
    markdown = gpu.render_markdown(result)
    assert "# GPU benchmark: NVIDIA H200, 2026-12-04" in markdown
    assert "| minilm (6x384) | cuda/bfloat16 | 10000 (256) | 4.00 | 2000 |" in markdown
    assert "| base | FAILED: skipped: time budget |" in markdown
    assert (
        "| minilm/default | `(default)` | 2 engine, 1 frontend | node | 12.0 | 0.999910 | ok |"
        in (markdown)
    )
    assert "FAILED: usage: ... / error: unrecognized arguments: --engines-per-device 2" in markdown
    assert (
        "| minilm/default/c1 | h2load | 1 | 250 | 0.03 | - | 2.00 | 5.00 | 1.20 | 55 | 1234 | "
        "0.900 | 12.5 | 0 | -/0.00/0.50/0.25/1.00/- |"
    ) in markdown
    assert "| minilm/default/c256 | FAILED: connect failed |" in markdown
    assert "- base/default: skipped, over the time budget" in markdown
    widths = {line.count("|") for line in markdown.splitlines() if line.startswith("| minilm/d")}
    assert len(widths) == 2  # the server table's width and the rows table's, failed rows too


def test_gpu_sampler_reads_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in nvidia-smi printing as `--format=csv,noheader,nounits -lms 100` does."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\nwhile true; do echo '37, 1234'; sleep 0.05; done\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.setitem(sys.modules, "pynvml", None)  # nvidia-smi even where pynvml exists
    sampler = gpu.GpuSampler()
    assert sampler.start() and sampler.source == "nvidia-smi"
    started = time.monotonic()
    try:
        time.sleep(0.5)
    finally:
        sampler.stop()
    assert sampler.window(started, time.monotonic()) == {
        "gpu_busy_pct": 37.0,
        "gpu_mem_mib": 1234.0,
    }
    assert sampler.window(0.0, 1.0) == {"gpu_busy_pct": None, "gpu_mem_mib": None}


def test_a_refused_server_is_recorded_in_its_own_words() -> None:
    usage = (
        "server exited with 2:\nusage: pooling-server [-h]\n"
        "   [--log-level {debug,info,warning,error}]\n"
        "pooling-server: error: unrecognized arguments: --engines-per-device 2"
    )
    assert gpu.server_error(RuntimeError(usage)) == (
        "pooling-server: error: unrecognized arguments: --engines-per-device 2"
    )
    crash = (
        "server exited with 1:\nTraceback (most recent call last):\n  File x\nRuntimeError: boom"
    )
    assert gpu.server_error(RuntimeError(crash)) == "RuntimeError: boom"
