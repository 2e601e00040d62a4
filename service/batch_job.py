"""`pooling-server batch`: a file of OpenAI batch lines in, a file of answers out.

The models load in this process (no server, no port); each line
`{"custom_id", "method": "POST", "url", "body"}` is parsed and rendered by the HTTP route
of its url (service/http/openai.py) and run through the RequestRunner, so its answer is the
one the HTTP API would give. What the job promises:

- Every line gets exactly one output line, in input order; a bad line (not JSON, an
  unknown url, a method other than POST, an invalid body, an engine refusal) becomes an
  error line and the job goes on.
- Memory is bounded by the window of lines in flight (--batch-window), not by the file:
  input is read in chunks and answers are written as the window's head completes.
- --resume reads the output first, cuts a trailing line left half-written by a kill, and
  skips the input lines already answered there; custom_ids may repeat (each occurrence is
  one line: a custom_id found k times in the output skips its first k occurrences).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import os
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

import msgspec

from pooling_server.engine.errors import ErrorKind, FieldViolation, PoolingError
from pooling_server.engine.scheduling.engine import Engine
from pooling_server.service.errors import FieldMap, http_error
from pooling_server.service.http.door import MAX_RESPONSE_BYTES, budget
from pooling_server.service.http.json_body import BodyError, decode, malformed
from pooling_server.service.http.openai import ROUTES, Parsed, Route
from pooling_server.service.ops.config import BatchJobOptions, ServerConfig
from pooling_server.service.ops.metrics import Metrics
from pooling_server.service.ops.telemetry import Telemetry
from pooling_server.service.runner import Call, RequestRunner

log = logging.getLogger(__name__)

READ_CHUNK_BYTES = 1 << 20  # input read per step, in whole lines
WRITE_CHUNK_BYTES = 1 << 18  # output written when this much is ready, or the head waits
MAX_LINE_BYTES = MAX_RESPONSE_BYTES  # one answer's JSON, as the HTTP API caps a response
QUEUE_FULL_RETRY_S = 0.05

_encode = msgspec.json.Encoder()


class _Done(msgspec.Struct):
    """What --resume reads of an output line."""

    custom_id: Any = None


@dataclass
class JobStats:
    lines: int = 0  # answered in this run
    errors: int = 0
    skipped: int = 0  # already in the output (--resume)
    seconds: float = 0.0


# ------------------------------------------------------------------ one line


# Ids: one random part per job and a counter (a uuid4 per line costs a system call).
_JOB = uuid.uuid4().hex[:20]
_serial = itertools.count()


def _line_id() -> str:
    return f"batch_req_{_JOB}{next(_serial):012x}"


def _output(custom_id: Any, status: int, request_id: str, body: dict[str, Any]) -> bytes:
    """OpenAI's batch output line. A failure also sets `error` (as vLLM's run-batch does),
    so a reader that checks only `error`, or only the status code, sees it."""
    error = None
    if status >= 400:
        detail = body.get("error", {})
        error = {"code": detail.get("code"), "message": detail.get("message")}
    line = {
        "id": _line_id(),
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": request_id, "body": body},
        "error": error,
    }
    return _encode.encode(line) + b"\n"


def _pooling_error_line(
    custom_id: Any, request_id: str, error: PoolingError, names: FieldMap | None = None
) -> bytes:
    """An error line, as the HTTP API's OpenAI/vLLM routes answer it (service/errors.py),
    its fields in the route's names."""
    answer = http_error(error, names=names)
    return _output(custom_id, answer.status, request_id, answer.body)


class _Line(msgspec.Struct):
    """A batch input line; its body stays raw JSON for the route's own body reader."""

    custom_id: Any = None
    method: Any = "POST"
    url: Any = None
    body: msgspec.Raw = msgspec.Raw()


_decode_line = msgspec.json.Decoder(_Line)


def read_line(raw: bytes, number: int) -> _Line:
    """The decoded line, or PoolingError; a custom_id that is not a scalar reads as None."""
    try:
        line = _decode_line.decode(raw)
    except msgspec.ValidationError:
        raise malformed(f"line {number} is not a JSON object") from None
    except (msgspec.DecodeError, RecursionError) as exc:
        raise malformed(f"line {number} is not valid JSON: {exc}") from None
    if not isinstance(line.custom_id, (str, int, float, bool)):
        line.custom_id = None  # echoed as null: it must be a string
    return line


def parse_line(line: _Line, number: int, max_inputs: int) -> tuple[Route, Parsed]:
    """The route and its parsed body, or PoolingError (BodyError among them). The body is
    decoded as the HTTP route decodes it (service/http/json_body.py), with the same bounds."""
    if not isinstance(line.custom_id, str):
        raise PoolingError(
            ErrorKind.INVALID_ARGUMENT, "INVALID_LINE", f"line {number}: custom_id must be a string"
        )
    method = line.method
    if not isinstance(method, str) or method.upper() != "POST":
        raise PoolingError(
            ErrorKind.INVALID_ARGUMENT, "METHOD_NOT_ALLOWED", f"line {number}: method must be POST"
        )
    route = ROUTES.get(line.url) if isinstance(line.url, str) else None
    if route is None:
        known = ", ".join(sorted(ROUTES))
        message = f"line {number}: url must be one of {known}"
        raise PoolingError(ErrorKind.NOT_FOUND, "UNKNOWN_URL", message)
    if not len(line.body):
        raise BodyError("body", "must be a JSON object")
    body = decode(bytes(line.body), route.body, max_inputs)
    request_id = f"{route.prefix}-{_JOB}{next(_serial):012x}"
    parsed = route.parse(body, request_id)
    if parsed.binary:
        description = "an output line is JSON: bytes answers are for HTTP; use base64"
        violation = FieldViolation(
            "encoding_format", description, "ENCODING_NOT_SUPPORTED_FOR_TASK"
        )
        raise PoolingError.invalid([violation])
    return route, parsed


class LineRunner:
    """Runs decoded lines through the request runner and renders each as an output line."""

    def __init__(self, runner: RequestRunner) -> None:
        self.runner = runner
        self.budget = budget(
            MAX_LINE_BYTES, item_bytes=64, setting="the batch job's line limit (64 MiB)"
        )

    def start(self, line: _Line, number: int) -> bytes | asyncio.Task[bytes]:
        """The answer now (a line refused before running), or a task that makes it."""
        custom_id = line.custom_id
        try:
            max_inputs = self.runner.ready().limits.max_client_batch_size
            route, parsed = parse_line(line, number, max_inputs)
        except PoolingError as error:  # a line or body refused before any route ran
            return _pooling_error_line(custom_id, "", error)
        return asyncio.ensure_future(self._run(custom_id, route, parsed))

    async def _run(self, custom_id: Any, route: Route, parsed: Parsed) -> bytes:
        parsed = parsed.budgeted(dataclasses.replace(self.budget, float_bytes=parsed.float_bytes))
        request = parsed.request
        call = Call(protocol="batch", rpc=route.rpc, client="batch")
        run = route.operation(self.runner)
        while True:
            try:
                ran = await run(request, call)
                return _output(custom_id, 200, request.request_id, parsed.render(ran.result))
            except PoolingError as error:
                if error.kind is ErrorKind.RESOURCE_EXHAUSTED and error.reason == "QUEUE_FULL":
                    await asyncio.sleep(QUEUE_FULL_RETRY_S)  # the window outgrew the queue
                    continue
                return _pooling_error_line(custom_id, request.request_id, error, parsed.names)


async def answer_lines(lines: LineRunner, raws: list[bytes], first_number: int) -> list[bytes]:
    """One shard's output lines, in input order: each raw line as `run_job` answers it (a
    blank line has none). `batch --ray`'s actors answer their shards with it."""
    answers: list[bytes | asyncio.Task[bytes]] = []
    for number, raw in enumerate(raws, first_number):
        if not raw.strip():
            continue
        try:
            answers.append(lines.start(read_line(raw, number), number))
        except PoolingError as error:
            answers.append(_pooling_error_line(None, "", error))
    return [a if isinstance(a, bytes) else await a for a in answers]


def new_runner(engine: Engine, config: ServerConfig | None = None) -> RequestRunner:
    """A request runner over an engine already loaded, without a server around it. With
    `config`'s --model-repository, a line naming a repository model loads it (once)."""
    runner = RequestRunner(Telemetry(Metrics()))
    runner.engine = engine
    if config is not None and config.model_repository:
        from pooling_server.service.repository import in_process

        runner.repository = in_process(config, engine)
    return runner


# ------------------------------------------------------------------ files


def read_done(path: str) -> collections.Counter[Any]:
    """How often each custom_id is already answered in `path`, after cutting a last line
    that a kill left without its newline (it is answered again)."""
    done: collections.Counter[Any] = collections.Counter()
    if not os.path.exists(path):
        return done
    with open(path, "rb+") as file:
        size = file.seek(0, os.SEEK_END)
        end = size
        while end > 0:  # find the last newline, reading backwards in chunks
            start = max(0, end - READ_CHUNK_BYTES)
            file.seek(start)
            at = file.read(end - start).rfind(b"\n")
            if at >= 0:
                end = start + at + 1
                break
            end = start
        if end < size:
            log.warning("cut a partial last line (%d bytes) from %s", size - end, path)
            file.truncate(end)
        file.seek(0)
        decode = msgspec.json.Decoder(_Done)
        for number, raw in enumerate(file, 1):
            if not raw.strip():
                continue
            try:
                done[decode.decode(raw).custom_id] += 1
            except msgspec.DecodeError:
                log.warning("%s line %d is not an output line; ignored", path, number)
    return done


def count_lines(path: str) -> int | None:
    """Lines in the input, for the progress bar's time left (None for stdin)."""
    if path == "-":
        return None
    count = 0
    with open(path, "rb") as file:
        while chunk := file.read(READ_CHUNK_BYTES):
            count += chunk.count(b"\n")
        if file.tell() and not chunk.endswith(b"\n"):
            file.seek(-1, os.SEEK_END)
            count += file.read(1) != b"\n"
    return count


def _chunks(stream: IO[bytes]) -> Iterator[list[bytes]]:
    while lines := stream.readlines(READ_CHUNK_BYTES):
        yield lines


# ------------------------------------------------------------------ the job


async def run_job(
    engine: Engine, options: BatchJobOptions, config: ServerConfig | None = None
) -> JobStats:
    """Answer every line of the input; the engine is started and stopped by the caller.
    `config`: its --model-repository's models load on demand (`new_runner`)."""
    lines = LineRunner(new_runner(engine, config))
    stats = JobStats()
    begun = time.monotonic()
    done = read_done(options.output) if options.resume else collections.Counter()
    source = sys.stdin.buffer if options.input == "-" else open(options.input, "rb")  # noqa: SIM115
    if options.output == "-":
        sink: IO[bytes] = sys.stdout.buffer
    else:
        sink = open(options.output, "ab" if options.resume else "wb")  # noqa: SIM115
    show = sys.stderr.isatty() if options.progress is None else options.progress
    bar = _progress(options.input, show, sum(done.values()))
    window: collections.deque[bytes | asyncio.Task[bytes]] = collections.deque()
    pending: list[bytes] = []
    pending_bytes = 0

    def flush() -> None:
        nonlocal pending_bytes
        if pending:
            sink.write(b"".join(pending))
            sink.flush()
            if bar is not None:
                bar.update(len(pending))
            pending.clear()
            pending_bytes = 0

    async def retire(wait: bool) -> None:
        """Write the finished head of the window; with `wait`, the head at least."""
        nonlocal pending_bytes
        while window:
            head = window[0]
            if isinstance(head, asyncio.Task):
                if not head.done():
                    if not wait:
                        return
                    flush()  # what is ready goes out before the wait
                    await asyncio.wait([head])
                head = head.result()
            window.popleft()
            wait = False
            stats.lines += 1
            stats.errors += b'"error":null}' not in head[-16:]
            pending.append(head)
            pending_bytes += len(head)
            if pending_bytes >= WRITE_CHUNK_BYTES:
                flush()

    number = 0
    chunks = _chunks(source)
    try:
        while chunk := await asyncio.to_thread(next, chunks, None):  # type: ignore[arg-type]
            for raw in chunk:
                number += 1
                if not raw.strip():
                    continue
                try:
                    line = read_line(raw, number)
                    custom_id, answer = line.custom_id, None
                except PoolingError as error:
                    custom_id, answer = None, _pooling_error_line(None, "", error)
                if done and done[custom_id] > 0:
                    done[custom_id] -= 1
                    stats.skipped += 1
                    continue
                window.append(answer if answer is not None else lines.start(line, number))
                if len(window) >= options.window:
                    await retire(wait=True)
                else:
                    await retire(wait=False)
        while window:
            await retire(wait=True)
        flush()
    finally:
        for item in window:
            if isinstance(item, asyncio.Task):
                item.cancel()
        if source is not sys.stdin.buffer:
            source.close()
        if sink is not sys.stdout.buffer:
            sink.close()
        if bar is not None:
            bar.close()
    stats.seconds = time.monotonic() - begun
    return stats


def _progress(path: str, show: bool, initial: int) -> Any:
    """tqdm on stderr: lines per second and, for a file, the time left."""
    if not show:
        return None
    from tqdm import tqdm

    return tqdm(
        total=count_lines(path), initial=initial, unit="line", file=sys.stderr, smoothing=0.1
    )


async def run_main(config: ServerConfig, options: BatchJobOptions) -> int:
    """`pooling-server batch`: load the models in this process, answer the file, report."""
    from transformers.utils import logging as hf_logging

    from pooling_server.service.loading import load_engine  # torch and transformers: only here

    hf_logging.disable_progress_bar()
    engine = await asyncio.to_thread(load_engine, config)
    await engine.start()
    try:
        stats = await run_job(engine, options, config)
    finally:
        await engine.stop()
    log.info(
        "batch done: %d lines answered (%d errors), %d already done, in %.1f s (%.0f lines/s)",
        stats.lines,
        stats.errors,
        stats.skipped,
        stats.seconds,
        stats.lines / stats.seconds if stats.seconds else 0.0,
    )
    return 0
