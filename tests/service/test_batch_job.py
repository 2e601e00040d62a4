"""`pooling-server batch`: the real CLI as a subprocess on real files.

Mixed routes and bad lines in one file, --resume after a SIGKILL mid-file, stdin/stdout,
a 100,000-line file in bounded memory, and each route's line answered with the body the
HTTP route gives (both run service/http/openai.py). Tiny random-weight fixture models on torch.
"""

from __future__ import annotations

import base64
import collections
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

from tests.reliability.support import report
from tests.server_process import free_port, start_server

ROOT = Path(__file__).resolve().parents[2]
MIXED_LINES = 8_000
BIG_LINES = 100_000


def cli(models: dict[str, Path], *args: str, embed_only: bool = False) -> list[str]:
    served = ["--model", f"emb={models['tiny-bert']}"]
    if not embed_only:
        served += ["--model", f"ce={models['tiny-cross-encoder']}"]
        served += ["--model", f"cls={models['tiny-classifier']}"]
    return [
        sys.executable,
        "-m",
        "pooling_server.service.launch",
        "batch",
        *served,
        "--backend",
        "torch",
        "--dtype",
        "float32",
        "--no-progress",
        *args,
    ]


def run_job(
    command: list[str], stdin: str | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """A batch job run to its end, with its output and log captured."""
    return subprocess.run(
        command, cwd=ROOT, input=stdin, capture_output=True, text=True, timeout=timeout
    )


def line(custom_id: str, url: str, body: dict[str, Any], method: str = "POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def mixed_line(i: int) -> str:
    """Mostly embeddings, with every other route and every kind of bad line among them."""
    kind = i % 50
    cid = f"req-{i}"
    if kind == 1:
        return line(cid, "/v1/rerank", {"model": "ce", "query": f"q {i}", "documents": ["a", "b"]})
    if kind == 2:
        return line(cid, "/v1/score", {"model": "ce", "text_1": "x", "text_2": ["y", f"z {i}"]})
    if kind == 3:
        return line(cid, "/classify", {"model": "cls", "input": [f"good {i}"]})
    if kind == 4:
        return line(cid, "/pooling", {"model": "emb", "input": f"p {i}", "task": "token_embed"})
    if kind == 5:
        return "{not json"
    if kind == 6:
        return line(cid, "/v1/embeddings", {"input": "x"}, method="GET")
    if kind == 7:
        return line(cid, "/v1/nowhere", {"input": "x"})
    if kind == 8:
        return line(cid, "/v1/embeddings", {"model": "emb", "input": 42})
    if kind == 9:
        return line(cid, "/v1/embeddings", {"model": "no-such-model", "input": "x"})
    if kind == 10:
        return line(cid, "/classify", {"model": "emb", "input": ["a"]})  # the engine refuses
    if kind == 11:  # a line's answer is JSON: vLLM's bytes answers are for HTTP
        return line(
            cid, "/v1/embeddings", {"model": "emb", "input": "x", "encoding_format": "bytes"}
        )
    return line(cid, "/v1/embeddings", {"model": "emb", "input": f"text number {i}"})


EXPECTED = {  # kind -> (status, error code)
    1: (200, None),
    2: (200, None),
    3: (200, None),
    4: (200, None),
    5: (400, "MALFORMED_REQUEST"),
    6: (405, "METHOD_NOT_ALLOWED"),
    7: (404, "UNKNOWN_URL"),
    8: (422, "INVALID_BODY"),
    9: (404, "MODEL_NOT_FOUND"),
    11: (400, "ENCODING_NOT_SUPPORTED_FOR_TASK"),
}


def read_output(path: Path) -> list[dict[str, Any]]:
    return [json.loads(text) for text in path.read_text().splitlines()]


def comparable(body: dict[str, Any]) -> Any:
    """An answer without what differs from run to run (ids, timestamps); floats as arrays."""
    body = {k: v for k, v in body.items() if k not in ("id", "created")}
    return body


def assert_same_answers(left: dict[str, Any], right: dict[str, Any]) -> None:
    assert left["custom_id"] == right["custom_id"]
    a, b = left["response"], right["response"]
    assert a["status_code"] == b["status_code"], (left, right)
    if a["status_code"] != 200:
        assert a["body"]["error"]["code"] == b["body"]["error"]["code"]
        return
    x, y = comparable(a["body"]), comparable(b["body"])
    if "data" in x:
        for p, q in zip(x.pop("data"), y.pop("data"), strict=True):
            for key in ("embedding", "data", "probs", "score"):
                if key in p:
                    np.testing.assert_allclose(np.array(p[key]), np.array(q[key]), atol=1e-5)
    if "results" in x:
        for p, q in zip(x.pop("results"), y.pop("results"), strict=True):
            assert abs(p.pop("relevance_score") - q.pop("relevance_score")) < 1e-5
            assert p == q
    assert x == y


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("batch") / "mixed.jsonl"
    with path.open("w") as file:
        for i in range(MIXED_LINES):
            file.write(mixed_line(i) + "\n")
            if i == 20:
                file.write("\n")  # blank lines are skipped, as in vLLM's run-batch
    return path


@pytest.fixture(scope="module")
def clean(model_folders: dict[str, Path], mixed: Path) -> list[dict[str, Any]]:
    out = mixed.with_name("clean.jsonl")
    done = run_job(cli(model_folders, "--input", str(mixed), "--output", str(out)))
    assert done.returncode == 0, done.stderr[-3000:]
    return read_output(out)


def test_mixed_routes_and_bad_lines(clean: list[dict[str, Any]]) -> None:
    assert len(clean) == MIXED_LINES  # one answer per line; the blank line none
    for i, answer in enumerate(clean):
        kind = i % 50
        status, code = EXPECTED.get(kind, (200, None))
        if kind == 10:  # an embedding model cannot classify: a 4xx from the engine's rules
            assert 400 <= answer["response"]["status_code"] < 500, answer
            status = answer["response"]["status_code"]
        assert answer["id"].startswith("batch_req_")
        assert answer["custom_id"] == (None if kind == 5 else f"req-{i}"), answer
        response = answer["response"]
        assert response["status_code"] == status, answer
        if status == 200:
            assert answer["error"] is None
        else:
            assert answer["error"]["code"] == response["body"]["error"]["code"]
            if code is not None:
                assert answer["error"]["code"] == code, answer
    body = clean[0]["response"]["body"]
    assert body["object"] == "list" and len(body["data"][0]["embedding"]) == 32
    assert clean[0]["response"]["request_id"].startswith("embd-")
    rerank = clean[1]["response"]["body"]
    assert sorted(r["index"] for r in rerank["results"]) == [0, 1]
    assert clean[2]["response"]["body"]["data"][1]["object"] == "score"
    assert clean[3]["response"]["body"]["data"][0]["num_classes"] == 3
    rows = clean[4]["response"]["body"]["data"][0]["data"]
    assert len(rows) > 2 and len(rows[0]) == 32  # a row per token
    assert clean[8]["response"]["body"]["error"]["param"] == "input"


def test_resume_after_sigkill_loses_and_repeats_nothing(
    model_folders: dict[str, Path],
    mixed: Path,
    clean: list[dict[str, Any]],
    record_property: Callable[[str, object], None],
) -> None:
    out = mixed.with_name("resumed.jsonl")
    # A small window writes often, so the kill lands between (and inside) writes.
    args = ["--input", str(mixed), "--output", str(out), "--batch-window", "64"]
    job = subprocess.Popen(
        cli(model_folders, *args), cwd=ROOT, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 240
    written = 0
    while time.monotonic() < deadline and job.poll() is None:
        written = out.stat().st_size if out.exists() else 0
        if written > 600_000:  # several hundred lines in
            break
        time.sleep(0.01)
    assert job.poll() is None, "the job finished before it could be killed"
    job.send_signal(signal.SIGKILL)
    job.wait(timeout=30)
    killed = out.read_bytes()
    cut_partial = not killed.endswith(b"\n")
    complete = killed.count(b"\n")
    assert 0 < complete < MIXED_LINES
    with out.open("ab") as file:  # as a kill inside a write leaves it
        file.write(b'{"id":"batch_req_x","custom_id":"req-')
    done = run_job(cli(model_folders, *args, "--resume"))
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = read_output(out)
    assert collections.Counter(a["custom_id"] for a in resumed) == collections.Counter(
        a["custom_id"] for a in clean
    )
    assert len(resumed) == len(clean)
    for left, right in zip(resumed, clean, strict=True):  # input order, across the kill
        assert_same_answers(left, right)
    report(
        record_property,
        "batch_resume",
        lines=MIXED_LINES,
        killed_after_lines=complete,
        kill_left_partial_line=cut_partial,
        lost=0,
        repeated=0,
    )


def test_stdin_to_stdout(model_folders: dict[str, Path]) -> None:
    lines = [mixed_line(i) for i in range(12)]
    done = run_job(
        cli(model_folders, "--input", "-", "--output", "-"), stdin="\n".join(lines) + "\n"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    answers = [json.loads(text) for text in done.stdout.splitlines()]
    assert [a["custom_id"] for a in answers] == [None if i == 5 else f"req-{i}" for i in range(12)]
    assert answers[0]["response"]["status_code"] == 200
    assert "batch done: 12 lines answered" in done.stderr


def test_resume_needs_an_output_file(model_folders: dict[str, Path]) -> None:
    done = run_job(cli(model_folders, "--input", "-", "--output", "-", "--resume"), timeout=60)
    assert done.returncode == 2 and "--resume needs --output to be a file" in done.stderr


def test_100k_lines_in_bounded_memory(
    model_folders: dict[str, Path],
    tmp_path: Path,
    record_property: Callable[[str, object], None],
) -> None:
    source, out = tmp_path / "big.jsonl", tmp_path / "big-out.jsonl"
    body = '"method": "POST", "url": "/v1/embeddings", "body": {"model": "emb", "input": "hi"}}'
    with source.open("w") as file:
        for i in range(BIG_LINES):
            file.write(f'{{"custom_id": "{i}", {body}\n')
    started = time.monotonic()
    job = subprocess.Popen(
        cli(model_folders, "--input", str(source), "--output", str(out), embed_only=True),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    process = psutil.Process(job.pid)
    samples: list[tuple[int, int]] = []  # (lines written, rss)
    while job.poll() is None:
        try:
            rss = process.memory_info().rss
        except psutil.NoSuchProcess:
            break
        size = out.stat().st_size if out.exists() else 0
        samples.append((size, rss))
        time.sleep(0.05)
    stderr = job.stderr.read() if job.stderr else ""
    assert job.wait() == 0, stderr[-3000:]
    seconds = time.monotonic() - started
    total = out.stat().st_size
    answers = out.read_bytes().count(b"\n")
    assert answers == BIG_LINES
    # Memory once a tenth of the answers are out (models loaded, the window full) against
    # the peak after: the window bounds it, not the file.
    early = [rss for size, rss in samples if size >= total // 10]
    assert early, "too few samples"
    baseline, peak = early[0], max(early)
    growth_mb = (peak - baseline) / 2**20
    report(
        record_property,
        "batch_100k_rss",
        lines=BIG_LINES,
        seconds=round(seconds, 1),
        input_mb=round(source.stat().st_size / 2**20, 1),
        output_mb=round(total / 2**20, 1),
        rss_at_10pct_mb=round(baseline / 2**20, 1),
        peak_rss_mb=round(peak / 2**20, 1),
        growth_mb=round(growth_mb, 1),
    )
    assert growth_mb < 40, f"RSS grew {growth_mb:.1f} MB over the file"
    assert os.path.getsize(out) > 0


# Each route once, and refusals: a batch line's body must be the HTTP route's body.
SAME_AS_HTTP = [
    ("/v1/embeddings", {"model": "emb", "input": ["one text", "and another one"]}),
    ("/v1/embeddings", {"model": "emb", "input": "in base64", "encoding_format": "base64"}),
    ("/v1/score", {"model": "ce", "text_1": "x", "text_2": ["y", "z z"]}),
    ("/score", {"model": "ce", "text_1": ["a", "b"], "text_2": ["c", "d"]}),
    ("/classify", {"model": "cls", "input": ["good", "bad news"], "use_activation": False}),
    ("/pooling", {"model": "emb", "input": "p q", "task": "token_embed"}),
    ("/pooling", {"model": "emb", "input": ["v"]}),
    ("/pooling", {"model": "cls", "input": ["w"], "task": "classify"}),
    (
        "/v1/rerank",
        {
            "model": "ce",
            "query": "q",
            "documents": ["a", "b c", "d"],
            "top_n": 2,
            "return_documents": True,
        },
    ),
    ("/rerank", {"model": "ce", "query": "q", "documents": ["a", "b"]}),
    ("/v1/embeddings", {"model": "emb", "input": 42}),  # the body reader refuses
    ("/v1/embeddings", {"model": "no-such-model", "input": "x"}),  # the engine refuses
    ("/classify", {"model": "emb", "input": ["a"]}),
    ("/pooling", {"model": "emb", "input": "x", "task": "nothing"}),
]


def same_body(batch: Any, http: Any, where: str = "body") -> None:
    """Equal JSON, but for ids and timestamps; floats (and base64 vectors) to 1e-5, since
    the two runs may batch inputs differently."""
    if isinstance(batch, dict):
        assert isinstance(http, dict) and batch.keys() == http.keys(), (where, batch, http)
        for key in batch:
            if key not in ("id", "created"):
                same_body(batch[key], http[key], f"{where}.{key}")
    elif isinstance(batch, list):
        assert isinstance(http, list) and len(batch) == len(http), (where, batch, http)
        for i, (a, b) in enumerate(zip(batch, http, strict=True)):
            same_body(a, b, f"{where}[{i}]")
    elif isinstance(batch, float):
        assert isinstance(http, float) and abs(batch - http) < 1e-5, (where, batch, http)
    elif isinstance(batch, str) and where.endswith(".embedding"):
        a, b = (np.frombuffer(base64.b64decode(s), dtype="<f4") for s in (batch, http))
        np.testing.assert_allclose(a, b, atol=1e-5, err_msg=where)
    else:
        assert type(batch) is type(http) and batch == http, (where, batch, http)


def test_batch_line_answers_as_the_http_route(
    model_folders: dict[str, Path], tmp_path: Path
) -> None:
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(
        "".join(line(f"r{i}", url, body) + "\n" for i, (url, body) in enumerate(SAME_AS_HTTP))
    )
    done = run_job(cli(model_folders, "--input", str(source), "--output", str(out)))
    assert done.returncode == 0, done.stderr[-3000:]
    batch = read_output(out)
    served = cli(model_folders)[4:-1]  # the same models, backend and dtype, as a server
    http_port = free_port()
    server = start_server([*served, "--http-port", str(http_port)], tmp_path, "same")
    try:
        for answer, (url, body) in zip(batch, SAME_AS_HTTP, strict=True):
            request = urllib.request.Request(
                f"http://127.0.0.1:{http_port}{url}", data=json.dumps(body).encode()
            )
            request.add_header("Content-Type", "application/json")
            try:
                with urllib.request.urlopen(request, timeout=60) as response:
                    status, got = response.status, json.loads(response.read())
            except urllib.error.HTTPError as error:
                status, got = error.code, json.loads(error.read())
            assert answer["response"]["status_code"] == status, (url, body, answer, got)
            same_body(answer["response"]["body"], got, url)
    finally:
        server.stop(signal.SIGTERM)


def test_a_line_naming_a_repository_model_loads_it_once(
    model_folders: dict[str, Path], tmp_path: Path
) -> None:
    """--model-repository: the first lines naming a repository model load it (one load for
    them all, however many wait), and its answers equal a job given the model with --model."""
    repository = tmp_path / "models"
    repository.mkdir()
    (repository / "rep-st").symlink_to(model_folders["tiny-st-mean"], target_is_directory=True)
    texts = [f"repository line {i}" for i in range(12)]
    source = tmp_path / "in.jsonl"
    bodies = [
        line(f"r{i}", "/v1/embeddings", {"model": "rep-st", "input": t})
        for i, t in enumerate(texts)
    ]
    bodies.append(line("other", "/v1/embeddings", {"model": "no-such-model", "input": "x"}))
    source.write_text("".join(b + "\n" for b in bodies))

    on_demand, given = tmp_path / "on-demand.jsonl", tmp_path / "given.jsonl"
    args = ["--input", str(source), "--model-repository", str(repository)]
    done = run_job(cli(model_folders, *args, "--output", str(on_demand), embed_only=True))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("loading model rep-st from") == 1, done.stderr[-3000:]
    loaded = read_output(on_demand)
    assert loaded[-1]["response"]["status_code"] == 404
    assert loaded[-1]["response"]["body"]["error"]["code"] == "MODEL_NOT_FOUND"

    started = ["--model", f"rep-st={model_folders['tiny-st-mean']}", "--input", str(source)]
    done = run_job(cli(model_folders, *started, "--output", str(given), embed_only=True))
    assert done.returncode == 0, done.stderr[-3000:]
    for got, want in zip(loaded[:-1], read_output(given)[:-1], strict=True):
        assert got["response"]["status_code"] == 200, got
        np.testing.assert_allclose(
            got["response"]["body"]["data"][0]["embedding"],
            want["response"]["body"]["data"][0]["embedding"],
            rtol=1e-5,
            atol=1e-6,
        )
