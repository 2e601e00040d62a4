"""Cohere's v2 HTTP routes, POST /v2/embed and POST /v2/rerank, as the Cohere SDK
(`cohere.ClientV2(base_url=...)`) and vLLM speak them.

/v2/embed takes `texts` (or `inputs` of text content), `input_type` mapped onto one of
the model's prompts (INPUT_TYPE_PROMPTS; --cohere-input-type-prompt adds or overrides),
`embedding_types` (float, int8, uint8, binary, ubinary, base64: one engine run at float,
then each type packed by engine/requests/encodings.py exactly as the engine packs it),
`truncate` (NONE, START, END: Cohere's default END cuts the end of a long input),
`max_tokens` and `output_dimension`. /v2/rerank takes `query`, `documents`, `top_n`,
`max_tokens_per_doc` and (this server's extension) an LLM reranker's `instruction`.
Answers and errors ({"id", "message"}) are in Cohere's shapes; the app renders errors
from service/errors.py, COHERE_FIELDS naming the engine's fields.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, ClassVar

import msgspec
import numpy as np
from aiohttp import web

from pooling_server.engine.errors import ErrorKind, FieldViolation, PoolingError, internal_error
from pooling_server.engine.models.model_info import ModelInfo
from pooling_server.engine.requests.encodings import quantize, ranges_array
from pooling_server.engine.requests.outputs import Embedding
from pooling_server.engine.requests.params import OutputEncoding, PoolingParams, Task
from pooling_server.engine.requests.request import Item, PoolRequest, RerankRequest
from pooling_server.service.errors import FieldMap
from pooling_server.service.http.bodies import (
    ContentPart,
    InputAudioPart,
    Int32,
    Texts,
    content_item,
    has_image,
)
from pooling_server.service.http.door import (
    JSON_FLOAT_BYTES,
    OFF_LOOP_BODY,
    REQUEST_ID,
    DoorHost,
    base64_floats,
    budget,
    call,
    json_response,
    new_request_id,
    read_body,
    refused,
    render,
)
from pooling_server.service.http.door import request_id as make_request_id
from pooling_server.service.http.image_parts import image_from_url
from pooling_server.service.runner import RequestRunner

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# Which of a model's prompts each input_type takes: the first name the model has. None
# found: no prompt beyond the model's default one (as for a model without prompts).
INPUT_TYPE_PROMPTS: dict[str, tuple[str, ...]] = {
    "search_query": ("query", "search_query", "retrieval.query", "retrieval_query"),
    "search_document": (
        "document",
        "passage",
        "search_document",
        "doc",
        "retrieval.passage",
        "retrieval_document",
    ),
    "classification": ("classification",),
    "clustering": ("clustering",),
}
EMBEDDING_TYPES = {
    "float": None,  # the values themselves
    "base64": None,  # float32 little-endian bytes, base64
    "int8": OutputEncoding.INT8,
    "uint8": OutputEncoding.UINT8,
    "binary": OutputEncoding.BINARY,
    "ubinary": OutputEncoding.UBINARY,
}
TRUNCATE_SIDES = {"START": "left", "END": "right"}
API_VERSION = {"version": "2"}
# The engine's fields as Cohere's, and Cohere's advice for a long input.
COHERE_FIELDS = FieldMap(
    fields={
        "embed.texts": "texts",
        "score.text_2": "documents",
        "score.text_1": "query",
        "params.dimensions": "output_dimension",
        "params.truncate_prompt_tokens": "max_tokens",
    },
    advice={"INPUT_TOO_LONG": "shorten it or set truncate to END or START"},
)
COHERE_RPCS = {"/v2/embed": "Pool", "/v2/rerank": "Rerank"}  # for a refusal's metrics


def input_type_prompts(overrides: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """INPUT_TYPE_PROMPTS with --cohere-input-type-prompt TYPE=PROMPT_NAME entries first;
    raises ValueError for a malformed entry."""
    table = dict(INPUT_TYPE_PROMPTS)
    for entry in overrides:
        input_type, sep, prompt = entry.partition("=")
        if not sep or not input_type.strip() or not prompt.strip():
            raise ValueError(f"--cohere-input-type-prompt {entry!r}: expected TYPE=PROMPT_NAME")
        input_type, prompt = input_type.strip(), prompt.strip()
        table[input_type] = (prompt, *(p for p in table.get(input_type, ()) if p != prompt))
    return table


# ------------------------------------------------------------------- bodies


class CohereInput(msgspec.Struct):
    """One of Cohere's inputs: its content parts (texts joined, or one image)."""

    content: list[ContentPart]


class CohereEmbed(msgspec.Struct):
    """Cohere's v2 EmbedRequest: `texts`, `images` (data URLs) or `inputs`, one of them."""

    texts: Texts | None = None
    images: Texts | None = None
    inputs: list[CohereInput] | None = None
    model: str = ""
    input_type: str | None = None
    embedding_types: list[str] | None = None
    truncate: str | None = None
    max_tokens: Int32 | None = None
    output_dimension: Int32 | None = None
    counted: ClassVar[tuple[str, ...]] = ("texts", "images", "inputs")


class CohereDocument(msgspec.Struct):
    text: str


class CohereRerank(msgspec.Struct):
    """Cohere's v2 RerankRequest."""

    query: str | None = None
    documents: list[str | CohereDocument] | None = None
    model: str = ""
    top_n: Int32 | None = None
    max_tokens_per_doc: Int32 | None = None
    return_documents: bool = False
    instruction: str | None = None  # an LLM reranker's (this server's extension)
    counted: ClassVar[tuple[str, ...]] = ("documents",)


# Each route's body, as service/http/openapi.py documents it.
COHERE_BODIES: dict[str, tuple[type, ...]] = {
    "/v2/embed": (CohereEmbed,),
    "/v2/rerank": (CohereRerank,),
}


# ------------------------------------------------------------------- ids


def with_request_id(handler: Handler, prefix: str) -> Handler:
    """The request's id (the caller's X-Request-Id, or a new one) set before the route
    runs, so that its errors carry it as Cohere's do; one that is not UTF-8 is refused,
    answered with a new id."""

    async def identified(request: web.Request) -> web.StreamResponse:
        try:
            request[REQUEST_ID] = make_request_id(request, prefix)
        except PoolingError:
            request[REQUEST_ID] = new_request_id(prefix)
            raise
        return await handler(request)

    return identified


# ------------------------------------------------------------------- routes


class CohereRoutes:
    def __init__(self, api: DoorHost, prompts: Mapping[str, tuple[str, ...]] | None = None) -> None:
        self.api = api
        self.prompts = dict(prompts or INPUT_TYPE_PROMPTS)

    @property
    def runner(self) -> RequestRunner:
        return self.api.runner

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v2/embed", with_request_id(self.embed, "embed")),
            web.post("/v2/rerank", with_request_id(self.rerank, "rerank")),
        ]

    def prompt_for(self, input_type: str | None, info: ModelInfo) -> str | None:
        """The model's prompt for `input_type`, or None (the model's default applies);
        "image" (Cohere's input_type for images) takes none."""
        if input_type is None or input_type == "image":
            return None
        if input_type not in self.prompts:
            known = ", ".join(sorted(self.prompts))
            raise refused("input_type", f"must be one of {known}, got {input_type[:64]!r}")
        return next((name for name in self.prompts[input_type] if name in info.prompts), None)

    async def embed(self, request: web.Request) -> web.Response:
        max_inputs = self.runner.limits.max_client_batch_size
        body = await read_body(request, CohereEmbed, max_inputs)
        if (request.content_length or 0) > OFF_LOOP_BODY:  # base64 of large images
            items = await asyncio.to_thread(_embed_items, body, max_inputs)
        else:
            items = _embed_items(body, max_inputs)
        images = has_image(items)
        texts = [] if images else items
        types = body.embedding_types or ["float"]
        for n, name in enumerate(types):
            if name not in EMBEDDING_TYPES:
                known = ", ".join(EMBEDDING_TYPES)
                raise refused(f"embedding_types[{n}]", f"must be one of {known}, got {name[:64]!r}")
        truncate = (body.truncate or "END").upper()
        if truncate not in ("NONE", "START", "END"):
            raise refused("truncate", "must be NONE, START or END")
        limit = body.max_tokens
        if limit is not None and limit < 1:
            raise refused("max_tokens", "must be at least 1")
        pool = PoolRequest(
            task=Task.EMBED,
            params=PoolingParams(dimensions=body.output_dimension),
            request_id=request[REQUEST_ID],
            model=body.model,
            texts=() if images else tuple(items),  # type: ignore[arg-type]
            items=tuple(items) if images else (),
            truncation_side=TRUNCATE_SIDES.get(truncate),
            response_budget=budget(self.api.max_response_bytes, JSON_FLOAT_BYTES * len(set(types))),
        )

        def prepare(info: ModelInfo) -> PoolRequest:
            """What depends on the model, once the runner has resolved it: the calibration
            int8 needs, max_tokens as a ceiling, input_type's prompt."""
            if Task.EMBED not in info.tasks and Task.EMBED_MULTI in info.tasks:
                raise _multi_vector_refusal(info)
            for n, name in enumerate(types):
                wanted = EMBEDDING_TYPES[name]
                if (
                    wanted in (OutputEncoding.INT8, OutputEncoding.UINT8)
                    and not info.calibration_ranges
                ):
                    raise refused(
                        f"embedding_types[{n}]",
                        f'{name} needs calibration ranges, and model "{info.name}" ships none '
                        "(calibration_ranges.json in its folder)",
                        "CALIBRATION_RANGES_MISSING",
                    )
            cut, over = (None if truncate == "NONE" else -1), None  # -1: the model's maximum
            if limit is not None:
                # A ceiling, as on rerank: past the model's maximum it is the maximum.
                ceiling = max(min(limit, info.max_input_tokens), info.num_special_tokens)
                # truncate NONE: a longer input is refused (by the engine), not cut.
                cut, over = (None, ceiling) if truncate == "NONE" else (ceiling, None)
            params = replace(pool.params, truncate_prompt_tokens=cut)
            prompt = None if images else self.prompt_for(body.input_type, info)
            return replace(pool, params=params, prompt_name=prompt, max_tokens=over)

        try:
            ran = await self.runner.pool(pool, call(request, "Pool"), prepare=prepare)
        except PoolingError as error:
            if not images:
                raise
            source = "images" if body.images is not None else "inputs"
            raise _cohere_item_paths(error, source) from None
        result, info = ran.result, ran.info
        assert info is not None
        vectors = [_embedding(output).values for output in result.outputs]
        ranges = ranges_array(info.calibration_ranges)

        def build() -> dict[str, Any]:
            stacked = np.stack(vectors) if vectors else np.zeros((0, 0), np.float32)
            embeddings: dict[str, Any] = {}
            for name in dict.fromkeys(types):
                embeddings[name] = _typed(stacked, name, ranges)
            return {
                "id": pool.request_id,
                "embeddings": embeddings,
                "texts": texts,
                "meta": {
                    "api_version": API_VERSION,
                    "billed_units": {"input_tokens": result.prompt_tokens},
                },
                "response_type": "embeddings_by_type",
            }

        values = sum(v.size for v in vectors) * len(types)
        return await render(build, values, self.api.max_response_bytes)

    async def rerank(self, request: web.Request) -> web.Response:
        body = await read_body(request, CohereRerank, self.runner.limits.max_client_batch_size)
        if body.query is None:
            raise refused("query", "missing; send a string")
        if body.documents is None:
            raise refused("documents", "missing; send a list of strings")
        documents = [d if isinstance(d, str) else d.text for d in body.documents]
        top_n = body.top_n
        if top_n is not None and top_n < 1:
            raise refused("top_n", "must be at least 1")
        scored = documents
        if body.max_tokens_per_doc is not None:
            if body.max_tokens_per_doc < 1:
                raise refused("max_tokens_per_doc", "must be at least 1")
            scored = await self._cut_documents(body.model, documents, body.max_tokens_per_doc)
        rerank = RerankRequest(
            query=body.query,
            documents=tuple(scored),
            # Cohere truncates a long pair rather than refusing it.
            params=PoolingParams(truncate_prompt_tokens=-1),
            request_id=request[REQUEST_ID],
            model=body.model,
            top_n=top_n or 0,
            instruction=body.instruction,
        )
        ran = await self.runner.rerank(rerank, call(request, "Rerank"))
        results = []
        for ranked in ran.result.ranking:
            item: dict[str, Any] = {"index": ranked.index, "relevance_score": ranked.score}
            if body.return_documents:
                item["document"] = {"text": documents[ranked.index]}
            results.append(item)
        return json_response(
            {
                "id": rerank.request_id,
                "results": results,
                "meta": {
                    "api_version": API_VERSION,
                    "billed_units": {"search_units": 1},
                    "tokens": {"input_tokens": ran.result.prompt_tokens},
                },
            }
        )

    async def _cut_documents(self, model: str, documents: Sequence[str], limit: int) -> list[str]:
        """Each document cut after its first `limit` tokens (Cohere's max_tokens_per_doc),
        at the end of that token in its text; the query and the pair are not counted."""
        if not documents:  # the rerank refuses that itself, naming its own field
            return list(documents)
        tokenized = await self.runner.tokens(model, documents, add_special_tokens=False)
        cut = []
        for text, tokens in zip(documents, tokenized, strict=True):
            offsets = tokens.offsets
            cut.append(text[: offsets[limit - 1][1]] if len(offsets) > limit else text)
        return cut


def _multi_vector_refusal(info: ModelInfo) -> PoolingError:
    """A multi-vector (ColBERT) model on /v2/embed: Cohere's API has no embedding type for
    a matrix per text, so the refusal says where the matrices are served."""
    description = (
        f'model "{info.name}" is a multi-vector (ColBERT) model: it gives a matrix of token '
        "vectors per text, which Cohere's /v2/embed has no embedding type for; request the "
        'matrices by gRPC Pool embed_multi, or POST /pooling with "task": "embed_multi" '
        '(prompt_name "query" or "document")'
    )
    error = PoolingError.invalid([FieldViolation("model", description, "TASK_NOT_SUPPORTED")])
    error.kind = ErrorKind.FAILED_PRECONDITION  # as the engine refuses a task a model lacks
    return error


def _embed_items(body: CohereEmbed, max_inputs: int) -> list[Item]:
    """`texts`, `images` (data URLs), or each of `inputs`: its text parts joined by
    newlines, or its one image (image_url part). One of the three."""
    given = [
        name
        for name, value in (("texts", body.texts), ("images", body.images), ("inputs", body.inputs))
        if value is not None
    ]
    if len(given) > 1:
        raise refused(", ".join(given), "send one of them, not both")
    if body.texts is not None:
        return [body.texts] if isinstance(body.texts, str) else list(body.texts)
    if body.images is not None:
        urls = [body.images] if isinstance(body.images, str) else body.images
        return [image_from_url(url, f"images[{n}]") for n, url in enumerate(urls)]
    if body.inputs is None:
        raise refused("texts", "missing; send a list of strings (or images, or inputs)")
    if len(body.inputs) > max_inputs:
        raise refused(
            "inputs",
            f"{len(body.inputs)} inputs exceed the limit of {max_inputs}",
            "TOO_MANY_INPUTS",
        )
    for n, item in enumerate(body.inputs):
        if any(isinstance(part, InputAudioPart) for part in item.content):
            raise refused(
                f"inputs[{n}].content",
                "Cohere's content parts hold texts and images, no audio; send audio clips "
                "to /v1/embeddings (input_audio parts) or over gRPC",
                "AUDIO_NOT_SUPPORTED",
            )
    return [
        content_item(item.content, f"inputs[{n}].content") for n, item in enumerate(body.inputs)
    ]


def _cohere_item_paths(error: PoolingError, field: str) -> PoolingError:
    """An engine refusal of an item (`embed.items[3].image`) named by the Cohere field the
    item came from: `images[3]`, or `inputs[3].content`; of the items together
    (`embed.items`: too many images), by the field."""
    if error.kind is not ErrorKind.INVALID_ARGUMENT or not error.violations:
        return error
    suffix = "]" if field == "images" else "].content"

    def named(path: str) -> str:
        if path == "embed.items":
            return field
        if path.startswith("embed.items["):
            return f"{field}[{path[len('embed.items[') :].partition(']')[0]}{suffix}"
        return path

    return PoolingError.invalid([replace(v, field=named(v.field)) for v in error.violations])


def _embedding(output: Any) -> Embedding:
    if not isinstance(output, Embedding):
        raise internal_error()
    return output


def _typed(vectors: np.ndarray, name: str, ranges: np.ndarray | None) -> list[Any]:
    """One embedding type of every vector, as Cohere sends it."""
    if name == "float":
        return vectors.tolist()
    if name == "base64":
        return [base64_floats(row) for row in vectors]
    return quantize(vectors, EMBEDDING_TYPES[name], ranges).tolist()  # type: ignore[arg-type]
