"""`pooling-server batch --ray ADDRESS`: the real CLI as a driver of a real local Ray.

The same lines as `pooling-server batch` for a file with bad lines; every line exactly once
after an actor is SIGKILLed mid-job, and after the driver is, then --resume; a model that
cannot load fails the job in seconds with its error; a Parquet dataset in, Parquet out."""

from __future__ import annotations

import collections
import json
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.service.ray_cluster import start_cluster
from tests.service.test_batch_job import (
    ROOT,
    assert_same_answers,
    cli,
    mixed_line,
    read_output,
    run_job,
)

MIXED = 1_500
LONG = 6_000
SHARD = ["--ray-shard-lines", "200"]


@pytest.fixture(scope="module")
def address() -> Iterator[str]:
    yield from start_cluster()


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ray-batch") / "mixed.jsonl"
    path.write_text("".join(mixed_line(i) + "\n" for i in range(MIXED)))
    return path


@pytest.fixture(scope="module")
def long_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ray-batch") / "long.jsonl"
    lines = (
        json.dumps(
            {
                "custom_id": f"line-{i}",
                "method": "POST",
                "url": "/v1/embeddings",
                "body": {"model": "emb", "input": f"document {i} " * (1 + i % 7)},
            }
        )
        for i in range(LONG)
    )
    path.write_text("\n".join(lines) + "\n")
    return path


def ray_cli(models: dict[str, Path], address: str, *args: str, embed_only: bool = False) -> list:
    return cli(models, "--ray", address, *SHARD, *args, embed_only=embed_only)


def ids_once(path: Path, count: int) -> None:
    """Every line-<i> answered exactly once, in input order."""
    answers = read_output(path)
    seen = collections.Counter(answer["custom_id"] for answer in answers)
    repeated = [k for k, n in seen.items() if n > 1]
    assert not repeated, repeated[:5]
    assert [a["custom_id"] for a in answers] == [f"line-{i}" for i in range(count)]
    assert all(a["response"]["status_code"] == 200 for a in answers)


def test_bad_lines_answer_as_the_batch_job(
    model_folders: dict[str, Path], address: str, mixed: Path
) -> None:
    plain, on_ray = mixed.with_name("plain.jsonl"), mixed.with_name("on-ray.jsonl")
    done = run_job(cli(model_folders, "--input", str(mixed), "--output", str(plain)))
    assert done.returncode == 0, done.stderr[-3000:]
    args = ["--input", str(mixed), "--output", str(on_ray), "--ray-actors", "2"]
    done = run_job(ray_cli(model_folders, address, *args))
    assert done.returncode == 0, done.stderr[-3000:]
    left, right = read_output(plain), read_output(on_ray)
    assert len(left) == len(right) == MIXED
    for a, b in zip(left, right, strict=True):
        assert_same_answers(a, b)
    assert {b["response"]["status_code"] for b in right} >= {200, 400, 404, 405, 422}


def _wait_for_output(path: Path, process: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.stat().st_size > 0):
        assert process.poll() is None, process.stderr.read()[-3000:] if process.stderr else ""
        assert time.monotonic() < deadline, "no output line came"
        time.sleep(0.05)


def _actors(name: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        command = " ".join(process.info["cmdline"] or [])
        if command.startswith("ray::") and name in command:
            found.append(process)
    return found


def test_an_actor_killed_mid_job_is_replaced_and_every_line_answered_once(
    model_folders: dict[str, Path], address: str, long_file: Path
) -> None:
    out = long_file.with_name("actor-killed.jsonl")
    args = ["--input", str(long_file), "--output", str(out), "--ray-actors", "2"]
    command = ray_cli(model_folders, address, *args, embed_only=True)
    driver = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _wait_for_output(out, driver)
        victims = _actors("ShardAnswerer")
        assert victims, "no actor process found"
        victims[0].send_signal(signal.SIGKILL)
        _, stderr = driver.communicate(timeout=480)
    finally:
        driver.kill()
    assert driver.returncode == 0, stderr.decode()[-3000:]
    ids_once(out, LONG)


def test_a_killed_driver_resumes_with_no_line_lost_or_repeated(
    model_folders: dict[str, Path], address: str, long_file: Path
) -> None:
    out = long_file.with_name("driver-killed.jsonl")
    args = ["--input", str(long_file), "--output", str(out)]
    command = ray_cli(model_folders, address, *args, embed_only=True)
    driver = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _wait_for_output(out, driver)
        time.sleep(0.3)
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=30)
    finally:
        driver.kill()
    before = len(read_output(out)) if out.read_bytes().endswith(b"\n") else None
    assert before is None or before < LONG, "the job ended before the kill: nothing to resume"
    done = run_job([*command, "--resume"], timeout=480)
    assert done.returncode == 0, done.stderr[-3000:]
    ids_once(out, LONG)
    text = out.with_name(out.name + ".manifest").read_text()
    manifest = [json.loads(x) for x in text.splitlines() if x.strip()]
    assert manifest[0]["shard_lines"] == 200 and len({m["shard"] for m in manifest[1:]}) == 30


@pytest.mark.parametrize("broken", ["missing", "no-model-type"])
def test_a_model_that_cannot_load_fails_the_job_fast(
    model_folders: dict[str, Path], address: str, mixed: Path, tmp_path: Path, broken: str
) -> None:
    folder = tmp_path / "model"
    if broken == "no-model-type":
        folder.mkdir()
        (folder / "config.json").write_text("{}")
    command = ray_cli({"tiny-bert": folder}, address, embed_only=True)
    command += ["--input", str(mixed), "--output", str(tmp_path / "out.jsonl")]
    begun = time.monotonic()
    done = run_job(command, timeout=180)
    assert done.returncode != 0
    assert time.monotonic() - begun < 120  # seconds on a quiet host; a hang is the failure
    message = done.stderr[-2000:]
    assert str(folder) in message or "model_type" in message, message


def test_a_parquet_dataset_is_embedded_into_parquet_and_resumes_by_id(
    model_folders: dict[str, Path], address: str, tmp_path: Path
) -> None:
    texts = [f"row {i} " * (1 + i % 5) for i in range(300)] + [None]
    source = tmp_path / "in.parquet"
    pq.write_table(pa.table({"doc": list(range(301)), "body": texts}), source)
    out = tmp_path / "out"
    args = ["--input", str(source), "--output", str(out), "--input-format", "parquet"]
    args += ["--text-column", "body", "--id-column", "doc"]
    done = run_job(ray_cli(model_folders, address, *args, embed_only=True))
    assert done.returncode == 0, done.stderr[-3000:]
    table = pq.read_table(out)
    assert sorted(table.column("doc").to_pylist()) == list(range(301))
    rows = {row["doc"]: row for row in table.to_pylist()}
    assert rows[300]["embedding"] is None and rows[300]["error"].startswith("INVALID_ROW")
    assert all(rows[k]["error"] is None and len(rows[k]["embedding"]) == 32 for k in range(300))
    again = run_job(ray_cli(model_folders, address, *args, "--resume", embed_only=True))
    assert again.returncode == 0, again.stderr[-3000:]
    assert pq.read_table(out).num_rows == 301  # the checkpoint skipped every row written
