"""`pooling-server batch --ray [ADDRESS]`: a batch job's lines answered by actors of a Ray cluster.

Two inputs:
- OpenAI batch lines (the default `--input-format batch`): the same output lines and error
  lines as `pooling-server batch`, in input order. The driver cuts the input into shards of
  whole lines by byte offset (one pass counting newlines); each actor loads the models once
  and answers a shard's lines through the batch job's own LineRunner (service/batch_job.py),
  so a line means what it means on one machine. The driver writes shards in order.
- A dataset (`--input-format parquet|jsonl`, a `--text-column`): rows through PoolingStage
  (service/ray_stage.py), written as Parquet to the `--output` folder.

Resume. For batch lines the job keeps its own manifest beside the output
(`<output>.manifest`): a header naming the input and the shard size, then one line per shard
written, with the output's size after it. A shard is in the manifest only once its lines are
flushed and synced, so after a kill `--resume` cuts the output back to the last recorded size
and answers the shards not recorded: no line lost, none repeated. Ray Data's checkpointing
keeps ids of rows written by a Parquet sink; the batch format is one ordered JSONL file, which
that does not describe, so it has a manifest of its own. Datasets (Parquet out) use Ray
Data's checkpointing, keyed on `--id-column`.

An actor killed mid-job is restarted by Ray and its shard retried; the driver takes each
shard's answer once. An actor that cannot load its model fails the job with the model's error.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import ray
import ray.data
import ray.exceptions

from pooling_server.service.batch_job import (
    READ_CHUNK_BYTES,
    LineRunner,
    answer_lines,
    count_lines,
    new_runner,
)
from pooling_server.service.ops.config import BatchJobOptions, RayJobOptions, ServerConfig

log = logging.getLogger(__name__)

MANIFEST_VERSION = 1


# ------------------------------------------------------------------ shards


@dataclass(frozen=True)
class Shard:
    index: int
    offset: int  # bytes into the input
    length: int
    first_line: int  # the number of its first line (from 1), as error lines name it


def plan_shards(path: str, shard_lines: int) -> Iterator[Shard]:
    """Whole-line shards of `path`, found by one pass over its bytes."""
    index, start, number, lines_in = 0, 0, 1, 0
    position = 0
    with open(path, "rb") as file:
        while chunk := file.read(READ_CHUNK_BYTES):
            at = 0
            while True:
                newline = chunk.find(b"\n", at)
                if newline < 0:
                    break
                lines_in += 1
                at = newline + 1
                if lines_in == shard_lines:
                    end = position + at
                    yield Shard(index, start, end - start, number)
                    index, start, number, lines_in = index + 1, end, number + lines_in, 0
            position += len(chunk)
    if position > start:
        yield Shard(index, start, position - start, number)


class Manifest:
    """`<output>.manifest`: the input it answers, and each shard written with the output's
    size after it (see the module's docstring)."""

    def __init__(self, options: BatchJobOptions, shard_lines: int) -> None:
        self.path = options.output + ".manifest"
        stat = os.stat(options.input)
        self.header = {
            "version": MANIFEST_VERSION,
            "input": os.path.abspath(options.input),
            "input_bytes": stat.st_size,
            "shard_lines": shard_lines,
        }
        self.done: set[int] = set()
        self.output_bytes = 0
        self.lines = 0  # answered in the shards done
        self._file: Any = None

    def resume(self) -> None:
        """Read what an earlier run wrote; refuse a manifest of another input."""
        if not os.path.exists(self.path):
            raise SystemExit(f"--resume: no manifest {self.path}; run without --resume first")
        with open(self.path, "rb") as file:
            lines = file.read().split(b"\n")
        header = json.loads(lines[0])
        if header != self.header:
            raise SystemExit(f"--resume: {self.path} is of another input or shard size: {header}")
        for raw in lines[1:]:
            try:
                entry = json.loads(raw)
            except ValueError:
                continue  # the last line, half-written by a kill
            self.done.add(entry["shard"])
            self.output_bytes = max(self.output_bytes, entry["end"])
            self.lines += entry["lines"]

    def open(self, resume: bool) -> None:
        if resume:
            self._file = open(self.path, "ab")  # noqa: SIM115
            self._file.write(b"\n")  # ends a half-written last line, if any
        else:
            self._file = open(self.path, "wb")  # noqa: SIM115
            self._file.write(json.dumps(self.header).encode() + b"\n")
        self._file.flush()

    def record(self, shard: int, end: int, lines: int) -> None:
        entry = {"shard": shard, "end": end, "lines": lines}
        self._file.write(json.dumps(entry).encode() + b"\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


# ------------------------------------------------------------------ actors


class ShardAnswerer:
    """A Ray Data actor: the models loaded once; each shard's lines answered as
    `pooling-server batch` answers them."""

    def __init__(self, config: ServerConfig, path: str) -> None:
        from pooling_server.service.loading import load_engine

        self.engine = load_engine(config)
        self.path = path
        self.lines = LineRunner(new_runner(self.engine, config))
        self._started: asyncio.Future[None] | None = None

    async def __call__(self, batch: dict[str, Any]) -> Any:
        if self._started is None:  # once, in Ray's event loop for this actor's batches
            self._started = asyncio.ensure_future(self.engine.start())
        await self._started
        datas, counts, begun = [], [], []
        for offset, length, first in zip(
            batch["offset"], batch["length"], batch["first_line"], strict=True
        ):
            begun.append(time.time())
            raws = await asyncio.to_thread(_read_range, self.path, int(offset), int(length))
            answered = await answer_lines(self.lines, raws, int(first))
            datas.append(b"".join(answered))
            counts.append(len(answered))
        yield {"shard": batch["index"], "data": datas, "lines": counts, "begun": begun}


def _read_range(path: str, offset: int, length: int) -> list[bytes]:
    with open(path, "rb") as file:
        file.seek(offset)
        return file.read(length).splitlines(keepends=True)


# ------------------------------------------------------------------ the driver


def connect(address: str) -> None:
    """Join the cluster at `address`, or start a local Ray ("local"); a Ray this process
    already started (a program calling run_main) is kept."""
    quiet = {"log_to_driver": False, "configure_logging": False}
    if ray.is_initialized():
        pass
    elif address == "local":
        ray.init(num_cpus=len(os.sched_getaffinity(0)), include_dashboard=False, **quiet)
    else:
        ray.init(address=address, **quiet)
    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True  # shards come back in input order
    context.enable_progress_bars = False


def run_batch_lines(config: ServerConfig, job: BatchJobOptions, options: RayJobOptions) -> int:
    """Answer an OpenAI batch file on the cluster; the output as `pooling-server batch`'s."""
    manifest = Manifest(job, options.shard_lines)
    if job.resume:
        manifest.resume()
    shards = [
        s for s in plan_shards(job.input, options.shard_lines) if s.index not in manifest.done
    ]
    total = count_lines(job.input) or 0
    begun = time.monotonic()
    sink = open(job.output, "r+b" if job.resume else "wb")  # noqa: SIM115
    sink.truncate(manifest.output_bytes)
    sink.seek(manifest.output_bytes)
    manifest.open(job.resume)
    bar = _progress(job.progress, total, manifest.lines)
    answered, first_begun = 0, float("inf")
    try:
        if shards:
            dataset = ray.data.from_items([s.__dict__ for s in shards])
            dataset = dataset.map_batches(
                ShardAnswerer,
                fn_constructor_kwargs={"config": config, "path": os.path.abspath(job.input)},
                compute=_actors(options),
                batch_size=1,
                num_cpus=options.cpus_per_actor,
                num_gpus=options.gpus_per_actor,
            )
            for row in dataset.iter_rows():
                sink.write(row["data"])
                sink.flush()
                os.fsync(sink.fileno())
                manifest.record(int(row["shard"]), sink.tell(), int(row["lines"]))
                answered += int(row["lines"])
                first_begun = min(first_begun, float(row["begun"]))
                if bar is not None:
                    bar.update(int(row["lines"]))
    finally:
        sink.close()
        manifest.close()
        if bar is not None:
            bar.close()
    # The rate from the first shard an actor began (its models loaded) to the last line
    # written, as `pooling-server batch` counts from its first line read.
    seconds = time.time() - min(first_begun, time.time())
    log.info(
        "batch --ray done: %d lines answered in %.1f s (%.0f lines/s; %.1f s in all, actors "
        "starting included), %d shards already done",
        answered,
        seconds,
        answered / seconds if seconds else 0.0,
        time.monotonic() - begun,
        len(manifest.done),
    )
    return 0


def run_dataset(config: ServerConfig, job: BatchJobOptions, options: RayJobOptions) -> int:
    """Rows of a Parquet or JSONL dataset through PoolingStage, written as Parquet."""
    from pooling_server.service.ray_stage import PoolingStage

    if job.resume and options.id_column is None:
        raise SystemExit("--resume of a dataset needs --id-column (Ray Data's checkpoints)")
    checkpoint = job.output.rstrip("/") + ".checkpoint"
    if not job.resume:
        for path in (job.output, checkpoint):
            shutil.rmtree(path, ignore_errors=True)
    context = ray.data.DataContext.get_current()
    if options.id_column is not None:
        context.checkpoint_config = {
            "id_column": options.id_column,
            "checkpoint_path": os.path.abspath(checkpoint),
            # Kept after success too: --resume of a finished job then writes nothing again.
            "delete_checkpoint_on_success": False,
        }
    read = ray.data.read_parquet if options.input_format == "parquet" else ray.data.read_json
    dataset = read(job.input).map_batches(
        PoolingStage,
        fn_constructor_args=(config,),
        fn_constructor_kwargs={
            "task": options.task,
            "text_column": options.text_column,
            "dimensions": options.dimensions,
        },
        compute=_actors(options),
        batch_format="pyarrow",
        batch_size=256,
        num_cpus=options.cpus_per_actor,
        num_gpus=options.gpus_per_actor,
    )
    dataset.write_parquet(os.path.abspath(job.output))
    return 0


def _actors(options: RayJobOptions) -> ray.data.ActorPoolStrategy:
    return ray.data.ActorPoolStrategy(
        size=options.actors, max_tasks_in_flight_per_actor=options.in_flight_shards
    )


def _progress(show: bool | None, total: int, initial: int) -> Any:
    """tqdm on stderr: lines per second and the time left."""
    show = sys.stderr.isatty() if show is None else show
    if not show:
        return None
    from tqdm import tqdm

    return tqdm(total=total or None, initial=initial, unit="line", file=sys.stderr, smoothing=0.1)


def run_main(config: ServerConfig, job: BatchJobOptions) -> int:
    """`pooling-server batch --ray`: the job on a cluster (or a local Ray)."""
    options = job.ray
    assert options is not None
    if job.input == "-" or job.output == "-":
        raise SystemExit("--ray reads --input and writes --output as files (no - for stdin)")
    check_models(config)
    connect(options.address)
    run = run_batch_lines if options.input_format == "batch" else run_dataset
    try:
        return run(config, job, options)
    except ray.exceptions.RayError as error:  # an actor's failure, e.g. its model's error
        log.error("batch --ray failed: %s", _cause(error))
        return 1


def check_models(config: ServerConfig) -> None:
    """Each model's folder found before any actor starts, so a bad path fails at once (an
    actor resolves it again where it runs)."""
    from pooling_server.engine.models.folder_reading import resolve_path

    for spec in config.models:
        try:
            resolve_path(spec.source, spec.revision)
        except Exception as error:
            raise SystemExit(f"model {spec.source!r} cannot be loaded: {error}") from None


_RAISED = re.compile(r"^(\w+(?:\.\w+)*(?:Error|Exception|Exit)): (.*)$")


def _cause(error: BaseException) -> str:
    """What went wrong in the actor: the last error Ray's report names that is not Ray's own
    wrapper (the report carries the actor's traceback as text)."""
    named = [
        found.group(0)
        for line in str(error).splitlines()
        if (found := _RAISED.match(line.strip())) and not found.group(1).startswith("ray.")
    ]
    return named[-1] if named else f"{type(error).__name__}: {error}"
