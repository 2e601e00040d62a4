"""A Ray Data stage over the engine: rows of a Dataset in, pooling outputs as Arrow columns out.

    ds.map_batches(PoolingStage, fn_constructor_kwargs={"server_args": ["--model", path],
                   "task": "embed"}, compute=ray.data.ActorPoolStrategy(size=4),
                   batch_format="pyarrow", batch_size=256)

Each actor loads the model once, through the server's own flags and loader, and runs rows
through `Engine.pool` / `Engine.rerank`: the code the server runs, not a copy of it. With
`address` instead, the actor calls a running fleet over gRPC through the project's Python
client. `__call__` is an async generator, so Ray Data keeps several batches in flight per
actor, and each batch goes out as several requests at once: the engine's batching queue
stays full.

A row that the engine refuses gets its reason in the `error` column and nulls in the output
columns; the other rows of its request are answered again one by one, so a bad row never
fails its neighbours or the job. `ray` is imported by this module (and ray_batch.py) alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import pyarrow as pa

from pooling_server.service.ops.config import ServerConfig

# The tasks a stage runs: the engine's, and rerank (a query and its documents per row).
TASKS = (
    "embed",
    "classify",
    "score",
    "rerank",
    "embed_sparse",
    "embed_multi",
    "token_embed",
    "token_classify",
)
ENCODINGS = {"float32": pa.float32(), "float16": pa.float16()}
ERROR_COLUMN = "error"


@dataclass(frozen=True)
class StageOptions:
    """What every row of a stage asks; the request fields of the server's API."""

    task: str = "embed"
    model: str = ""  # a served model's name; "" for the default
    text_column: str = "text"
    # Bytes of an encoded image, or of an audio clip (WAV, FLAC, OGG); a null falls back to text.
    image_column: str | None = None
    text_1_column: str = "text_1"  # score: the pair's two sides
    text_2_column: str = "text_2"
    query_column: str = "query"  # rerank: the query and a list of documents per row
    documents_column: str = "documents"
    use_activation: bool | None = None
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None
    prompt_name: str | None = None
    prompt: str | None = None
    instruction: str | None = None  # rerank on an LLM reranker
    top_n: int = 0
    sparse_top_k: int = 0
    candidate_labels: tuple[str, ...] = ()  # classify on an image model: zero-shot
    encoding: str = "float32"  # of the vectors' Arrow lists: float32 or float16
    rows_per_request: int = 32  # a batch goes out as requests of this many rows, at once
    timeout_s: float | None = None  # client mode: each call's deadline

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, not {self.task!r}")
        if self.encoding not in ENCODINGS:
            raise ValueError(f"encoding must be float32 or float16, not {self.encoding!r}")
        if self.rows_per_request < 1:
            raise ValueError("rows_per_request must be at least 1")
        object.__setattr__(self, "candidate_labels", tuple(self.candidate_labels))

    def params(self) -> dict[str, Any]:
        """The PoolingParams fields (the engine's and the client's alike)."""
        return {
            "use_activation": self.use_activation,
            "dimensions": self.dimensions,
            "truncate_prompt_tokens": self.truncate_prompt_tokens,
        }


@dataclass
class Answers:
    """One batch's outputs in a common form, a row each: a value, or None and an error."""

    values: list[Any] = field(default_factory=list)
    errors: list[str | None] = field(default_factory=list)


class RowError(Exception):
    """A row the stage itself refuses (a missing column value) before any request."""


# ------------------------------------------------------------------ rows in


def _column(batch: pa.Table, name: str | None) -> list[Any] | None:
    if name is None or name not in batch.column_names:
        return None
    return batch.column(name).to_pylist()


def _pair_columns(
    batch: pa.Table, task: str, first: str, second: str
) -> tuple[list[Any], list[Any]]:
    """The two columns a pair task reads; ValueError naming them where either is missing."""
    a, b = _column(batch, first), _column(batch, second)
    if a is None or b is None:
        raise ValueError(f"{task} needs columns {first!r} and {second!r}")
    return a, b


def row_inputs(batch: pa.Table, options: StageOptions) -> list[Any]:
    """Each row's input: a text or media bytes, a (text_1, text_2) pair, or a (query,
    documents) rerank; a RowError where the row lacks it."""
    count = batch.num_rows
    if options.task == "score":
        firsts, seconds = _pair_columns(
            batch, "score", options.text_1_column, options.text_2_column
        )
        return [
            (a, b)
            if isinstance(a, str) and isinstance(b, str)
            else RowError("a pair needs two texts")
            for a, b in zip(firsts, seconds, strict=True)
        ]
    if options.task == "rerank":
        queries, documents = _pair_columns(
            batch, "rerank", options.query_column, options.documents_column
        )
        return [
            (q, tuple(d)) if isinstance(q, str) and d else RowError("needs a query and documents")
            for q, d in zip(queries, documents, strict=True)
        ]
    texts = _column(batch, options.text_column) or [None] * count
    images = _column(batch, options.image_column) or [None] * count
    if options.text_column not in batch.column_names and options.image_column is None:
        raise ValueError(f"the dataset has no column {options.text_column!r}")
    inputs: list[Any] = []
    for text, image in zip(texts, images, strict=True):
        if image is not None:
            inputs.append(bytes(image))
        elif isinstance(text, str):
            inputs.append(text)
        else:
            inputs.append(RowError("the row has no text (and no image)"))
    return inputs


def media(data: bytes) -> Any:
    """A row's bytes as the engine takes them: an audio clip where they begin as WAV, FLAC
    or OGG (by signature, as the Python client tells them), else an image."""
    from pooling_server.engine.families.clap.audio import sniff
    from pooling_server.engine.requests.request import Audio, Image

    return Audio(data) if sniff(data) is not None else Image(data)


# ------------------------------------------------------------------ outputs out


def _vectors(rows: list[np.ndarray | None], value_type: pa.DataType, known: int | None) -> pa.Array:
    """Fixed-size lists of one width (the rows', or `known` when none is answered), nulls
    where a row has none."""
    width = next((row.shape[-1] for row in rows if row is not None), known)
    if width is None:  # nothing answered, nor ever can be: the model refuses the options
        return pa.nulls(len(rows), pa.list_(value_type))
    dtype = np.float16 if value_type == pa.float16() else np.float32
    flat = np.zeros((len(rows), width), dtype=dtype)
    for k, row in enumerate(rows):
        if row is not None:
            flat[k] = row
    mask = pa.array([row is None for row in rows])
    return pa.FixedSizeListArray.from_arrays(
        pa.array(flat.reshape(-1), type=value_type), width, mask=mask
    )


def _matrices(
    rows: list[np.ndarray | None], value_type: pa.DataType, known: int | None
) -> pa.Array:
    """Lists of fixed-size lists: one matrix (tokens x width) a row, nulls where none."""
    width = next((row.shape[-1] for row in rows if row is not None), known)
    if width is None:
        return pa.nulls(len(rows), pa.list_(pa.list_(value_type)))
    dtype = np.float16 if value_type == pa.float16() else np.float32
    answered = [row.astype(dtype, copy=False) for row in rows if row is not None]
    flat = np.concatenate(answered).reshape(-1) if answered else np.zeros(0, dtype)
    inner = pa.FixedSizeListArray.from_arrays(pa.array(flat, type=value_type), width)
    offsets = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum([0 if row is None else row.shape[0] for row in rows], out=offsets[1:])
    return pa.ListArray.from_arrays(
        pa.array(offsets), inner, mask=pa.array([row is None for row in rows])
    )


def output_columns(
    task: str, answers: Answers, encoding: str, width: int | None = None
) -> dict[str, pa.Array]:
    """The task's Arrow columns from its answers (see docs/scale-out.md for the names);
    `width`: the vectors' width, for a batch with no row answered."""
    values = answers.values
    value_type = ENCODINGS[encoding]

    def each(key: str) -> list[Any]:
        return [None if v is None else v[key] for v in values]

    columns: dict[str, pa.Array]
    if task == "embed":
        columns = {"embedding": _vectors(each("vector"), value_type, width)}
    elif task == "classify":
        columns = {
            "probs": _vectors(each("probs"), pa.float32(), width),
            "label": pa.array(each("label"), pa.string()),
            "label_id": pa.array(each("label_id"), pa.int32()),
        }
    elif task == "score":
        columns = {"score": pa.array(each("score"), pa.float32())}
    elif task == "rerank":
        ranked = pa.struct([("index", pa.int32()), ("score", pa.float32())])
        columns = {"ranking": pa.array(each("ranking"), pa.list_(ranked))}
    elif task == "embed_sparse":
        columns = {
            "sparse_indices": pa.array(each("indices"), pa.list_(pa.int32())),
            "sparse_values": pa.array(each("values"), pa.list_(pa.float32())),
        }
    elif task == "token_classify":
        columns = {
            "token_labels": pa.array(each("labels"), pa.list_(pa.string())),
            "token_probs": _matrices(each("rows"), pa.float32(), width),
        }
    else:  # embed_multi and token_embed: a matrix a row
        name = "multi_vector" if task == "embed_multi" else "token_embeddings"
        columns = {name: _matrices(each("rows"), value_type, width)}
    columns[ERROR_COLUMN] = pa.array(answers.errors, pa.string())
    return columns


# ------------------------------------------------------------------ the callers


def server_config(server_args: Sequence[str] | ServerConfig) -> ServerConfig:
    """The server's flags as its parser reads them (no environment), or a config as is."""
    if isinstance(server_args, ServerConfig):
        return server_args
    from pooling_server.service.cli import config_from_args, parse_args

    return config_from_args(parse_args(list(server_args), environ={}))


class EngineCaller:
    """Rows through an engine loaded in this process, from the server's flags."""

    def __init__(self, server_args: Sequence[str] | ServerConfig, options: StageOptions) -> None:
        from pooling_server.engine.errors import PoolingError
        from pooling_server.service.loading import load_engine

        self.config = server_config(server_args)
        self.engine = load_engine(self.config)
        self.options = options
        self._error = PoolingError
        self._started: asyncio.Future[None] | None = None
        limit = self.engine.limits.max_client_batch_size
        self.rows_per_request = min(options.rows_per_request, limit)

    async def start(self) -> None:
        """Start the engine once, in the loop of the batches in flight (several at once)."""
        if self._started is None:
            self._started = asyncio.ensure_future(self._start())
        await self._started

    async def _start(self) -> None:
        """The engine started, and the stage's model loaded first if it is one of
        --model-repository's (service/repository.py): its rows then never wait on it."""
        await self.engine.start()
        model = self.options.model
        if model and self.config.model_repository and not self.engine.serves(model):
            from pooling_server.service.repository import in_process

            await in_process(self.config, self.engine).ensure(model, None)

    async def stop(self) -> None:
        if self._started is not None:
            await self._started
            await self.engine.stop()
            self._started = None

    def _params(self) -> Any:
        from pooling_server.engine.requests.params import PoolingParams

        return PoolingParams(**self.options.params())

    async def run(self, inputs: list[Any]) -> list[Any]:
        """One request's outputs, in the common form; PoolingError if it is refused."""
        from pooling_server.engine.requests.params import Task
        from pooling_server.engine.requests.request import PoolRequest, RerankRequest

        o = self.options
        if o.task == "rerank":
            ((query, documents),) = inputs
            result = await self.engine.rerank(
                RerankRequest(
                    query=query,
                    documents=documents,
                    params=self._params(),
                    model=o.model,
                    top_n=o.top_n,
                    instruction=o.instruction,
                )
            )
            ranking = [{"index": r.index, "score": r.score} for r in result.ranking]
            return [{"ranking": ranking}]
        task = Task(o.task)
        common: dict[str, Any] = {"task": task, "params": self._params(), "model": o.model}
        if task is Task.SCORE:
            common["text_1"] = tuple(a for a, _ in inputs)
            common["text_2"] = tuple(b for _, b in inputs)
        elif any(isinstance(i, bytes) for i in inputs) or o.candidate_labels:
            common["items"] = tuple(media(i) if isinstance(i, bytes) else i for i in inputs)
            common["candidate_labels"] = o.candidate_labels
        else:
            common["texts"] = tuple(inputs)
        if task not in (Task.SCORE, Task.TOKEN_CLASSIFY):
            common["prompt_name"], common["prompt"] = o.prompt_name, o.prompt
        if task is Task.EMBED_SPARSE:
            common["sparse_top_k"] = o.sparse_top_k
        result = await self.engine.pool(PoolRequest(**common))
        return [_engine_output(task, output) for output in result.outputs]


def _engine_output(task: Any, output: Any) -> dict[str, Any]:
    from pooling_server.engine.requests.params import Task

    if task is Task.EMBED:
        return {"vector": output.values}
    if task is Task.CLASSIFY:
        return {"probs": output.probs, "label": output.label, "label_id": output.label_id}
    if task is Task.SCORE:
        return {"score": output.value}
    if task is Task.EMBED_SPARSE:
        return {"indices": output.indices.tolist(), "values": output.values.tolist()}
    if task is Task.TOKEN_CLASSIFY:
        return {"rows": output.values, "labels": list(output.labels)}
    return {"rows": output.values}


class ClientCaller:
    """Rows through a running fleet over gRPC, with the project's Python client."""

    def __init__(self, address: str, options: StageOptions, client_kwargs: dict[str, Any]) -> None:
        from pooling_client import errors

        self.address = address
        self.options = options
        self.client_kwargs = client_kwargs
        self.client: Any = None
        self._error = errors.PoolingError
        self.rows_per_request = options.rows_per_request

    async def start(self) -> None:
        if self.client is None:  # made in the loop that uses it
            from pooling_client import AsyncPoolingClient

            self.client = AsyncPoolingClient(
                self.address,
                model=self.options.model or None,
                timeout=self.options.timeout_s,
                **self.client_kwargs,
            )

    async def stop(self) -> None:
        if self.client is not None:
            await self.client.close()
            self.client = None

    def _params(self) -> Any:
        from pooling_client import PoolingParams

        return PoolingParams(**self.options.params())

    async def run(self, inputs: list[Any]) -> list[Any]:
        o, client = self.options, self.client
        params = self._params()
        prompts = dict(prompt_name=o.prompt_name, prompt=o.prompt)
        if o.task == "rerank":
            ((query, documents),) = inputs
            answer = await client.rerank(
                query,
                list(documents),
                top_n=o.top_n or None,
                pooling_params=params,
                instruction=o.instruction,
            )
            ranking = [{"index": r.index, "score": r.relevance_score} for r in answer.results]
            return [{"ranking": ranking}]
        if o.task == "score":
            answers = await client.score(
                [a for a, _ in inputs], [b for _, b in inputs], pooling_params=params
            )
            return [{"score": a.outputs.score} for a in answers]
        if o.task == "embed":
            answers = await client.embed(inputs, pooling_params=params, **prompts)
            return [{"vector": np.asarray(a.outputs.numpy(), np.float32)} for a in answers]
        if o.task == "classify":
            answers = await client.classify(
                inputs, pooling_params=params, candidate_labels=list(o.candidate_labels) or None
            )
            return [
                {
                    "probs": np.asarray(a.outputs.probs, np.float32),
                    "label": a.outputs.label,
                    "label_id": a.outputs.label_id,
                }
                for a in answers
            ]
        if o.task == "embed_sparse":
            answers = await client.embed_sparse(
                inputs, pooling_params=params, top_k=o.sparse_top_k or None, **prompts
            )
            return [{"indices": a.outputs.indices, "values": a.outputs.values} for a in answers]
        extra = {} if o.task == "token_classify" else prompts
        answers = await client.encode(inputs, pooling_task=o.task, pooling_params=params, **extra)
        rows = [
            {"rows": np.asarray(a.outputs.data, np.float32), "labels": list(a.outputs.labels)}
            for a in answers
        ]
        return rows


# ------------------------------------------------------------------ the stage


class PoolingStage:
    """A callable class for `Dataset.map_batches` (batch_format="pyarrow").

    `server_args`: the server's model flags (`--model`, `--backend`, `--dtype`, `--device`,
    `--quantize`, `--max-batch-tokens`...) or a ServerConfig, for an engine in this actor;
    or `address` ("host:port" of a fleet) to call it over gRPC (`client_kwargs` go to the client:
    api_key, TLS, ...). The other keywords are StageOptions: the task, the columns, and the
    request's fields. Input columns pass through; the task's columns and `error` are added.
    """

    def __init__(
        self,
        server_args: Sequence[str] | ServerConfig = (),
        *,
        address: str | None = None,
        client_kwargs: dict[str, Any] | None = None,
        **options: Any,
    ) -> None:
        known = {f.name for f in fields(StageOptions)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown PoolingStage options: {', '.join(unknown)}")
        self.options = StageOptions(**options)
        self.width: int | None = None  # of the vectors, once known
        if address is not None and server_args:
            raise ValueError("give server_args (an engine here) or address (a fleet), not both")
        self.caller: EngineCaller | ClientCaller = (
            ClientCaller(address, self.options, client_kwargs or {})
            if address is not None
            else EngineCaller(server_args, self.options)
        )

    async def __call__(self, batch: pa.Table) -> AsyncIterator[pa.Table]:
        await self.caller.start()
        answers = await self.answer(row_inputs(batch, self.options))
        width = await self._width(answers)
        table = batch
        for name, column in output_columns(
            self.options.task, answers, self.options.encoding, width
        ).items():
            if name in table.column_names:
                table = table.drop_columns([name])
            table = table.append_column(name, column)
        yield table

    async def _width(self, answers: Answers) -> int | None:
        """The vectors' width, remembered from an answered row, or learnt from one probe text
        when no row has been: every block of a dataset then has one Arrow type. None for
        the tasks without vectors (score, rerank, embed_sparse)."""
        if self.options.task in ("score", "rerank", "embed_sparse"):
            return None
        if self.width is None and not any(v is not None for v in answers.values):
            answers = await self.answer(["width"])
        for value in answers.values:
            if value is not None:
                row = value.get("vector", value.get("probs", value.get("rows")))
                self.width = int(np.shape(row)[-1])
                break
        return self.width

    async def answer(self, inputs: list[Any]) -> Answers:
        """Every row's output or error: requests of rows_per_request rows, all at once."""
        per = 1 if self.options.task == "rerank" else self.caller.rows_per_request
        groups: list[list[int]] = []
        for k, item in enumerate(inputs):
            if isinstance(item, RowError):
                continue
            if not groups or len(groups[-1]) >= per:
                groups.append([])
            groups[-1].append(k)
        answers = Answers([None] * len(inputs), [None] * len(inputs))
        for k, item in enumerate(inputs):
            if isinstance(item, RowError):
                answers.errors[k] = f"INVALID_ROW: {item}"
        await asyncio.gather(*(self._group(inputs, group, answers) for group in groups))
        return answers

    async def _group(self, inputs: list[Any], group: list[int], answers: Answers) -> None:
        try:
            outputs = await self.caller.run([inputs[k] for k in group])
        except self.caller._error as error:
            if len(group) == 1:
                answers.errors[group[0]] = _describe(error)
                return
            # One row spoiled the request: each row again on its own, at once.
            await asyncio.gather(*(self._group(inputs, [k], answers) for k in group))
            return
        for k, output in zip(group, outputs, strict=True):
            answers.values[k] = output


def _describe(error: Exception) -> str:
    """`REASON: message`, as the errors table names a refusal."""
    reason = getattr(error, "reason", "") or type(error).__name__
    message = getattr(error, "message", None) or str(error)
    return f"{reason}: {message}"


def pool_dataset(
    dataset: Any,
    *,
    actors: int = 1,
    num_gpus: float = 0,
    num_cpus: float = 1,
    batch_size: int = 256,
    **stage: Any,
) -> Any:
    """`dataset` with a PoolingStage applied by `actors` actors (a convenience over
    map_batches; the keywords are PoolingStage's)."""
    import ray.data

    return dataset.map_batches(
        PoolingStage,
        fn_constructor_kwargs=stage,
        compute=ray.data.ActorPoolStrategy(size=actors),
        batch_format="pyarrow",
        batch_size=batch_size,
        num_gpus=num_gpus,
        num_cpus=num_cpus,
    )
