"""The JSON routes as data: each url's parse (JSON body -> engine request) and render
(engine result -> JSON body), with no web framework in sight.

The HTTP API (service/http/app.py) and offline batch jobs (service/batch_job.py) both
look a url up in ROUTES, parse the body (read by service/http/json_body.py), run the engine
request through the RequestRunner and render the result, so an HTTP answer and a batch
line's answer are made by the same code, and a new route is one entry in the table.
Rendering reads the engine's arrays directly: no protobuf round trip.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from pooling_server.engine.errors import FieldViolation, PoolingError
from pooling_server.engine.requests.output_size import ResponseBudget
from pooling_server.engine.requests.outputs import (
    Classification,
    Embedding,
    ItemOutput,
    LateChunks,
    MultiVector,
    PoolResult,
    RerankResult,
    Score,
    TextOutputs,
    TokenRows,
)
from pooling_server.engine.requests.params import Task
from pooling_server.engine.requests.request import (
    PoolRequest,
    RerankRequest,
)
from pooling_server.service.errors import FieldMap
from pooling_server.service.http.bodies import (
    ClassifyBody,
    EmbeddingsBody,
    PoolingBody,
    PoolingFields,
    RerankBody,
    ScoreBody,
    has_image,
    texts,
)
from pooling_server.service.http.door import JSON_FLOAT_BYTES, output_of
from pooling_server.service.http.float_format import (
    BinaryAnswer,
    FloatFormat,
    binary_answer,
    float_format,
)
from pooling_server.service.http.json_body import BodyError
from pooling_server.service.runner import Call, Ran, RequestRunner

Render = Callable[[Any], Any]  # a JSON-able dict, or a BinaryAnswer (binary routes)


@dataclass(frozen=True)
class Parsed:
    """A route's body, parsed: the engine request, and how to render its result."""

    request: PoolRequest | RerankRequest
    render: Render
    float_bytes: int = JSON_FLOAT_BYTES  # for the door's answer budget
    # The route's names for the engine's request paths in its refusals (None: the engine's).
    names: FieldMap | None = None
    binary: bool = False  # render gives a BinaryAnswer (encoding_format bytes), not JSON

    def budgeted(self, budget: ResponseBudget) -> Parsed:
        """The same, its answer bounded by the door's budget (a rerank's needs none)."""
        if not isinstance(self.request, PoolRequest):
            return self
        request = dataclasses.replace(self.request, response_budget=budget)
        return dataclasses.replace(self, request=request)


Operation = Callable[[Any, Call], Awaitable[Ran[Any]]]  # the runner's pool or rerank


@dataclass(frozen=True)
class Route:
    """`rpc`: the runner operation the route runs (Pool or Rerank), also its name in
    metrics; `prefix`: of generated request ids; `body`: the body's declared type."""

    rpc: str
    prefix: str
    body: type[PoolingFields]
    parse: Callable[[Any, str], Parsed]

    def operation(self, runner: RequestRunner) -> Operation:
        """The runner operation this route's requests take, picked once by a door."""
        return runner.rerank if self.rpc == "Rerank" else runner.pool  # type: ignore[return-value]


# ------------------------------------------------------------------ the routes


def parse_embeddings(body: EmbeddingsBody, request_id: str) -> Parsed:
    """OpenAI's POST /v1/embeddings, with vLLM's extra fields (truncate_prompt_tokens,
    use_activation or its older name normalize), as vLLM's own route takes them."""
    fmt = float_format(body)
    items = body.items()
    images = has_image(items)
    request = PoolRequest(
        task=Task.EMBED,
        params=body.params(body.dimensions),
        request_id=request_id,
        model=body.model or "",
        adapter=body.adapter or None,
        bypass_cache=bool(body.bypass_cache),
        texts=() if images else tuple(items),  # type: ignore[arg-type]
        items=tuple(items) if images else (),
        late_chunking=body.chunking(),
    )

    if fmt.binary:
        _whole_arrays(request)
        return _binary(request, fmt, lambda output: output_of(output, Embedding).values)

    def render(result: PoolResult) -> dict[str, Any]:
        data = []
        for index, output in enumerate(result.outputs):
            if isinstance(output, LateChunks):
                chunks = _chunks(output, fmt, "embedding")
                data.append({"object": "embedding", "index": index, "chunks": chunks})
                continue
            assert isinstance(output, Embedding)
            values = fmt.json(output.values)
            row = {"object": "embedding", "index": index, "embedding": values}
            if images:  # which tower embedded it (not in OpenAI's shape: only with images)
                row["modality"] = str(output.modality)
            data.append(row)
        return {"object": "list", "data": data, "model": result.model, "usage": usage(result)}

    return Parsed(request, render, fmt.float_bytes)


def parse_score(body: ScoreBody, request_id: str) -> Parsed:
    """vLLM's POST /v1/score: text_1 and text_2, each a string or a list; `instruction`:
    an LLM reranker's (its template's {instruction}), carried as gRPC's Pool carries it,
    as the score request's prompt, and named `instruction` in a refusal."""
    request = PoolRequest(
        task=Task.SCORE,
        params=body.params(),
        request_id=request_id,
        model=body.model or "",
        adapter=body.adapter or None,
        bypass_cache=bool(body.bypass_cache),
        **body.sides(),
        prompt=body.instruction,
    )

    def render(result: PoolResult) -> dict[str, Any]:
        data = []
        for index, output in enumerate(result.outputs):
            assert isinstance(output, Score)
            data.append({"index": index, "object": "score", "score": float(output.value)})
        return listing(request_id, result, data)

    return Parsed(request, render, names=SCORE_FIELDS)


def parse_classify(body: ClassifyBody, request_id: str) -> Parsed:
    """vLLM's POST /classify."""
    request = PoolRequest(
        task=Task.CLASSIFY,
        params=body.params(),
        request_id=request_id,
        model=body.model or "",
        adapter=body.adapter or None,
        bypass_cache=bool(body.bypass_cache),
        texts=texts(body.input),
    )

    def render(result: PoolResult) -> dict[str, Any]:
        data = []
        for index, output in enumerate(result.outputs):
            assert isinstance(output, Classification)
            probs = output.probs.tolist()
            data.append(
                {"index": index, "label": output.label, "probs": probs, "num_classes": len(probs)}
            )
        return listing(request_id, result, data)

    return Parsed(request, render)


def parse_pooling(body: PoolingBody, request_id: str) -> Parsed:
    """vLLM's POST /pooling: any task; `data` is a vector (or a row per token), or with
    encoding_format base64 its little-endian float32 bytes, rows one after another.
    embed_multi (ColBERT matrices) takes `prompt_name` "query" or "document" (the mode).
    embed_outputs (a bge-m3 model) takes `outputs`, a list of "dense", "sparse" and
    "multi", with `sparse_top_k` and `return_tokens` for the sparse one; each item then
    holds the asked outputs (see _text_outputs)."""
    task = body.task or "embed"
    fmt = float_format(body)
    request = PoolRequest(
        task=Task(task),
        params=body.params(body.dimensions),
        request_id=request_id,
        model=body.model or "",
        adapter=body.adapter or None,
        bypass_cache=bool(body.bypass_cache),
        texts=texts(body.input),
        prompt_name=(body.prompt_name or None) if task == "embed_multi" else None,
        late_chunking=body.chunking(),
        **(body.outputs_asked() if task == "embed_outputs" else {}),
    )

    if fmt.binary:
        _whole_arrays(request)
        return _binary(request, fmt, _pooled)

    def render(result: PoolResult) -> dict[str, Any]:
        data = []
        for index, output in enumerate(result.outputs):
            if isinstance(output, LateChunks):
                chunks = _chunks(output, fmt, "data")
                data.append({"index": index, "object": "pooling", "chunks": chunks})
                continue
            if isinstance(output, TextOutputs):
                data.append({"index": index, "object": "pooling", **_text_outputs(output, fmt)})
                continue
            data.append({"index": index, "object": "pooling", "data": fmt.json(_pooled(output))})
        return listing(request_id, result, data)

    return Parsed(request, render, fmt.float_bytes)


def parse_rerank(body: RerankBody, request_id: str) -> Parsed:
    """The Cohere/Jina shape that vLLM and Infinity serve at /v1/rerank and /rerank, plus
    an LLM reranker's `instruction`, as gRPC's RerankRequest.instruction."""
    documents = body.documents.items("documents")
    images = has_image(documents)
    texts: list[str] = [] if images else documents  # type: ignore[assignment]
    if body.query is None:
        raise BodyError("query", "must be a string")
    return_documents = bool(body.return_documents)  # Cohere's default: false
    request = RerankRequest(
        query=body.query,
        documents=tuple(texts),
        items=tuple(documents) if images else (),
        params=body.params(),
        request_id=request_id,
        model=body.model or "",
        adapter=body.adapter or None,
        bypass_cache=bool(body.bypass_cache),
        top_n=body.top_n or 0,
        instruction=body.instruction,
    )

    def render(result: RerankResult) -> dict[str, Any]:
        results = []
        for ranked in result.ranking:
            item: dict[str, Any] = {"index": ranked.index, "relevance_score": float(ranked.score)}
            if return_documents and not images:
                item["document"] = {"text": texts[ranked.index]}
            results.append(item)
        return {"id": request_id, "model": result.model, "results": results, "usage": usage(result)}

    return Parsed(request, render)


EMBEDDINGS = Route("Pool", "embd", EmbeddingsBody, parse_embeddings)
RERANK = Route("Rerank", "rerank", RerankBody, parse_rerank)
SCORE = Route("Pool", "score", ScoreBody, parse_score)

# url -> route: what the HTTP API serves (POST) and what a batch line may name.
ROUTES: dict[str, Route] = {
    "/v1/embeddings": EMBEDDINGS,
    "/v1/rerank": RERANK,
    "/rerank": RERANK,
    "/v1/score": SCORE,
    "/score": SCORE,
    "/pooling": Route("Pool", "pool", PoolingBody, parse_pooling),
    "/classify": Route("Pool", "classify", ClassifyBody, parse_classify),
}


# ------------------------------------------------------------------ helpers

# /score carries its `instruction` as the score request's prompt (as gRPC's Pool does).
SCORE_FIELDS = FieldMap(fields={"prompt": "instruction"})


def _pooled(output: ItemOutput) -> np.ndarray:
    """/pooling's array of one item: its vector, probabilities, or rows."""
    if isinstance(output, Classification):
        return output.probs
    return output_of(output, (Embedding, TokenRows, MultiVector)).values


def _whole_arrays(request: PoolRequest) -> None:
    """bytes answers hold one array an input: late chunks and embed_outputs' several
    outputs an input have no place in them."""
    if request.late_chunking is not None or request.task is Task.EMBED_OUTPUTS:
        what = "late chunking" if request.late_chunking is not None else "embed_outputs"
        description = f"bytes answers hold one array an input, which {what} does not; use base64"
        reason = "ENCODING_NOT_SUPPORTED_FOR_TASK"
        raise PoolingError.invalid([FieldViolation("encoding_format", description, reason)])


def _binary(
    request: PoolRequest, fmt: FloatFormat, array: Callable[[ItemOutput], np.ndarray]
) -> Parsed:
    """A route whose answer is its arrays' bytes (vLLM's bytes and bytes_only)."""

    def render(result: PoolResult) -> BinaryAnswer:
        head = listing(request.request_id, result, [])
        del head["data"], head["object"]
        return binary_answer(fmt, [array(output) for output in result.outputs], head)

    return Parsed(request, render, fmt.float_bytes, binary=True)


def _chunks(output: LateChunks, fmt: FloatFormat, key: str) -> list[dict[str, Any]]:
    """Each late chunk as {"span": [start, end], key: its vector}."""
    return [
        {"span": [start, end], key: fmt.json(embedding.values)}
        for (start, end), embedding in zip(output.spans, output.embeddings, strict=True)
    ]


def _text_outputs(output: TextOutputs, fmt: FloatFormat) -> dict[str, Any]:
    """One text's asked outputs: "dense" a vector, "sparse" {"indices", "values"} (and
    "tokens" when asked), "multi" a list of rows; with base64, the vector's and the
    matrix's float32 bytes (the matrix row after row, "multi_shape" [rows, cols])."""
    found: dict[str, Any] = {}
    if output.dense is not None:
        found["dense"] = fmt.json(output.dense.values)
    if output.sparse is not None:
        sparse = output.sparse
        found["sparse"] = {"indices": sparse.indices.tolist(), "values": sparse.values.tolist()}
        if sparse.tokens:
            found["sparse"]["tokens"] = sparse.tokens
    if output.multi is not None:
        found["multi"] = fmt.json(output.multi.values)
        if fmt.encoding == "base64":
            found["multi_shape"] = list(output.multi.values.shape)
    return found


def usage(result: PoolResult | RerankResult) -> dict[str, Any]:
    """OpenAI's usage; with OpenAI's `prompt_tokens_details.cached_tokens` where the result
    cache answered any of the tokens (docs/cache.md)."""
    found: dict[str, Any] = {
        "prompt_tokens": result.prompt_tokens,
        "total_tokens": result.prompt_tokens,
    }
    if result.cached_tokens:
        found["prompt_tokens_details"] = {"cached_tokens": result.cached_tokens}
    return found


def listing(request_id: str, result: PoolResult, data: list[Any]) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "list",
        "created": int(time.time()),
        "model": result.model,
        "data": data,
        "usage": usage(result),
    }
