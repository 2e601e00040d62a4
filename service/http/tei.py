"""TEI's HTTP routes (huggingface/text-embeddings-inference, docs/openapi.json) on the
HTTP port, so that clients written for TEI (huggingface_hub's InferenceClient,
LangChain's HuggingFaceEndpointEmbeddings, LlamaIndex's and Haystack's TEI embedders) can
point at this server.

Routes: POST /embed, /embed_all, /embed_sparse, /predict, /rerank, /similarity,
/tokenize, /decode, GET /info, and POST /, which TEI routes by the model's kind (and, as
Hugging Face's endpoints do, a sentence-similarity body on an embedding model goes to
/similarity; a token-classification model answers InferenceClient.token_classification
with entities, and an image model its zero_shot_image_classification). TEI serves one
model: here a request acts on the default model unless it names another in an optional
`model` field. /rerank is shared with the Cohere/Jina shape:
a body with `texts` and no `documents` is TEI's (see HttpApi.app).

Each route parses its body, runs engine requests through the RequestRunner, and renders
the engine's arrays in TEI's shapes. Errors are TEI's {"error", "error_type"} with its
statuses (400 Empty, 413 for too many inputs or too large a request or answer, 422
Validation, and Tokenizer for over-long inputs, 424 Backend when the model cannot do the
task, 429 Overloaded, 503 Unhealthy), rendered by the app from service/errors.py;
TEI_FIELDS names the engine's fields as TEI's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any, ClassVar

import msgspec
import numpy as np
from aiohttp import web

from pooling_server.engine.errors import PoolingError
from pooling_server.engine.families.colbert.multi_vector import MultiVectorSettings
from pooling_server.engine.inputs.tokenization import ModelTokenizer
from pooling_server.engine.models.model_info import (
    Activation,
    HeadKind,
    LongInput,
    ModelInfo,
    PoolingType,
)
from pooling_server.engine.requests.heads import activate
from pooling_server.engine.requests.output_size import entity_budget
from pooling_server.engine.requests.outputs import (
    Classification,
    Embedding,
    MultiVector,
    Score,
    SparseEmbedding,
    TokenRows,
)
from pooling_server.engine.requests.params import PoolingParams, Task
from pooling_server.engine.requests.request import PoolRequest, RerankRequest
from pooling_server.service.errors import Family, FieldMap
from pooling_server.service.http.bodies import Int32, Texts
from pooling_server.service.http.door import (
    FAMILY,
    B,
    DoorHost,
    budget,
    call,
    empty,
    json_response,
    matrix,
    output_of,
    present,
    read_body,
    refused,
    render,
    request_id,
    too_many,
)
from pooling_server.service.http.entities import (
    AGGREGATIONS,
    DEFAULT_AGGREGATION,
    DEFAULT_IGNORED,
    entities,
)
from pooling_server.service.http.image_parts import image_from_url
from pooling_server.service.http.token_json import tokenize_json
from pooling_server.service.ops.version import server_version
from pooling_server.service.runner import RequestRunner

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# The engine names fields by the gRPC request's paths; TEI's errors name TEI's fields,
# and advise TEI's truncate (a boolean) for a long input.
TEI_FIELDS = FieldMap(
    fields={
        "embed.texts": "inputs",
        "token_embed.texts": "inputs",
        "embed_multi.texts": "inputs",
        "embed_sparse.texts": "inputs",
        "classify.texts": "inputs",
        "token_classify.texts": "inputs",
        "classify.items": "inputs",
        "classify.candidate_labels": "parameters.candidate_labels",
        "classify.label_template": "parameters.hypothesis_template",
        "score.text_1": "inputs",
        "score.text_2": "inputs",
        "params.truncate_prompt_tokens": "truncate",
        "params.use_activation": "normalize",
        "params.dimensions": "dimensions",
    },
    advice={"INPUT_TOO_LONG": "shorten it or set truncate to true"},
)
# Each route's operation, as the metrics label a refusal made before the runner.
TEI_RPCS = {
    "/embed": "Pool",
    "/embed_all": "Pool",
    "/embed_sparse": "Pool",
    "/predict": "Pool",
    "/similarity": "Pool",
    "/rerank": "Rerank",
    "/tokenize": "Tokenize",
    "/decode": "Decode",
    "/": "Pool",
    "/info": "Info",
}
DIRECTIONS = {"left": "left", "right": "right"}


# ------------------------------------------------------------------- bodies


class TeiEmbed(msgspec.Struct, kw_only=True):
    """TEI's EmbedRequest (/embed, /embed_all, /embed_sparse)."""

    inputs: Texts
    normalize: bool = True
    truncate: bool | None = None
    truncation_direction: str | None = None
    prompt_name: str | None = None
    dimensions: Int32 | None = None
    model: str = ""
    counted: ClassVar[tuple[str, ...]] = ("inputs",)


class TextClassificationParameters(msgspec.Struct):
    """What huggingface_hub's InferenceClient.text_classification sends beside `inputs`."""

    top_k: Int32 | None = None
    function_to_apply: str | None = None  # sigmoid, softmax or none


class TokenClassificationParameters(msgspec.Struct):
    """What huggingface_hub's InferenceClient.token_classification sends beside `inputs`."""

    aggregation_strategy: str | None = None
    ignore_labels: list[str] | None = None
    stride: Int32 | None = None


class TeiTokenClassify(msgspec.Struct, kw_only=True):
    """A token-classification model's body on TEI's root route."""

    inputs: Texts
    parameters: TokenClassificationParameters | None = None
    truncate: bool | None = None
    truncation_direction: str | None = None
    model: str = ""
    counted: ClassVar[tuple[str, ...]] = ("inputs",)


class ZeroShotImageParameters(msgspec.Struct):
    """What InferenceClient.zero_shot_image_classification sends beside the image."""

    candidate_labels: list[str] = []
    hypothesis_template: str | None = None  # "This is a photo of {}." (the label at {})


class TeiZeroShotImage(msgspec.Struct):
    """An image model's zero-shot classification on TEI's root route."""

    inputs: str | None = None  # the image: base64, or a data URL
    parameters: ZeroShotImageParameters | None = None
    model: str = ""


class TeiPredict(msgspec.Struct, kw_only=True):
    """TEI's PredictRequest: a text, a pair [a, b], or a batch of [a] / [a, b]."""

    inputs: str | list[str | list[str]]
    raw_scores: bool = False
    truncate: bool | None = None
    truncation_direction: str | None = None
    model: str = ""
    # Sent by Hugging Face's Inference API clients (TEI ignores it): then the answer for a
    # single input is that API's [[{label, score}, ...]], which the client unwraps.
    parameters: TextClassificationParameters | None = None
    counted: ClassVar[tuple[str, ...]] = ("inputs",)


# The Inference API's function_to_apply, as the engine's own activations.
FUNCTIONS = {
    "sigmoid": Activation.SIGMOID,
    "softmax": Activation.SOFTMAX,
    "none": Activation.IDENTITY,
}


class TeiRerank(msgspec.Struct, kw_only=True):
    """TEI's RerankRequest."""

    query: str | None = None
    texts: Texts
    raw_scores: bool = False
    return_text: bool = False
    truncate: bool | None = None
    truncation_direction: str | None = None
    model: str = ""
    instruction: str | None = None  # an LLM reranker's (this server's extension)
    counted: ClassVar[tuple[str, ...]] = ("texts",)


class SimilarityInputs(msgspec.Struct):
    source_sentence: str
    sentences: list[str]


class SimilarityParameters(msgspec.Struct):
    prompt_name: str | None = None
    truncate: bool | None = None
    truncation_direction: str | None = None


class TeiSimilarity(msgspec.Struct):
    """TEI's SimilarityRequest (and InferenceClient.sentence_similarity's)."""

    inputs: SimilarityInputs | None = None
    parameters: SimilarityParameters | None = None
    model: str = ""


class TeiTokenize(msgspec.Struct, kw_only=True):
    """TEI's TokenizeRequest."""

    inputs: Texts
    add_special_tokens: bool = True
    prompt_name: str | None = None
    model: str = ""
    counted: ClassVar[tuple[str, ...]] = ("inputs",)


class TeiDecode(msgspec.Struct, kw_only=True):
    """TEI's DecodeRequest: a list of ids, or a list of id lists."""

    ids: list[int | list[int]]
    skip_special_tokens: bool = True
    model: str = ""
    counted: ClassVar[tuple[str, ...]] = ("ids",)


class _Shape(msgspec.Struct):
    """What picks a route from a body: TEI's rerank has `texts`, Cohere's `documents`; a
    similarity body's `inputs` is an object."""

    inputs: msgspec.Raw = msgspec.Raw()
    texts: msgspec.Raw = msgspec.Raw()
    documents: msgspec.Raw = msgspec.Raw()
    parameters: msgspec.Raw = msgspec.Raw()
    model: str = ""


# Each POST route's body, as service/http/openapi.py documents it; POST / takes the body of
# the route the model's kind picks.
TEI_BODIES: dict[str, tuple[type, ...]] = {
    "/embed": (TeiEmbed,),
    "/embed_all": (TeiEmbed,),
    "/embed_sparse": (TeiEmbed,),
    "/predict": (TeiPredict,),
    "/similarity": (TeiSimilarity,),
    "/tokenize": (TeiTokenize,),
    "/decode": (TeiDecode,),
    "/rerank": (TeiRerank,),
    "/": (TeiEmbed, TeiPredict, TeiRerank, TeiSimilarity, TeiTokenClassify, TeiZeroShotImage),
}


def _listed(texts: str | list[str]) -> list[str]:
    return [texts] if isinstance(texts, str) else texts


def _batch(texts: list[str], field: str, max_inputs: int) -> None:
    if not texts:
        raise empty(field)
    if len(texts) > max_inputs:
        raise too_many(len(texts), max_inputs, field)


def _side(direction: str | None) -> str | None:
    if direction is None:
        return None
    side = DIRECTIONS.get(direction.lower())
    if side is None:
        raise refused("truncation_direction", "must be Left or Right")
    return side


def _truncate(truncate: bool | None) -> int | None:
    """TEI's truncate: true cuts each input to the model's maximum; false or absent leaves
    the model's --long-input policy (reject, by default)."""
    return -1 if truncate else None


# ------------------------------------------------------------------- routes


class TeiRoutes:
    """TEI's routes over the runner; `api` lends the response cap (--max-http-response-mb)."""

    def __init__(self, api: DoorHost) -> None:
        self.api = api

    @property
    def runner(self) -> RequestRunner:
        return self.api.runner

    def routes(self) -> list[web.RouteDef]:
        post = {
            "/embed": self.embed,
            "/embed_all": self.embed_all,
            "/embed_sparse": self.embed_sparse,
            "/predict": self.predict,
            "/similarity": self.similarity,
            "/tokenize": self.tokenize,
            "/decode": self.decode,
            "/": self.root,
        }
        routes = [web.post(path, handler) for path, handler in post.items()]
        return [*routes, web.get("/info", self.info)]

    def rerank_or(self, other: Handler) -> Handler:
        """One /rerank for two shapes: TEI's ({query, texts}) here, its errors in TEI's
        envelope; anything else (Cohere's and Jina's {query, documents}) to `other`."""

        async def dispatch(request: web.Request) -> web.StreamResponse:
            try:
                shape = await self._decode(request, _Shape)
            except PoolingError:
                return await other(request)  # its own errors, in its own shape
            if present(shape.texts) and not present(shape.documents):
                request[FAMILY] = Family.TEI
                return await self.rerank(request)
            return await other(request)

        return dispatch

    @property
    def _max_inputs(self) -> int:
        return self.runner.limits.max_client_batch_size

    async def _decode(self, request: web.Request, kind: type[B]) -> B:
        """A TEI body as its declared type; its model, where the body names none, from
        `?model=` in the URL, so that clients that cannot put one in the body
        (huggingface_hub's InferenceClient, given the URL as its model) can still reach any
        model this server serves, as /info?model= does."""
        body = await read_body(request, kind, self._max_inputs)
        if not body.model:  # type: ignore[attr-defined]
            body.model = request.query.get("model", "")  # type: ignore[attr-defined]
        return body

    @property
    def _max_bytes(self) -> int:
        return self.api.max_response_bytes

    async def _pool(self, request: web.Request, pool: PoolRequest) -> Any:
        pool = _with_budget(pool, self._max_bytes)
        return (await self.runner.pool(pool, call(request, "Pool"))).result

    # POST / ----------------------------------------------------------------

    async def root(self, request: web.Request) -> web.StreamResponse:
        """TEI's POST /: the route for the model's kind."""
        shape = await self._decode(request, _Shape)
        served = self.runner.ready().model_named(shape.model)
        info = served.info
        if Task.TOKEN_CLASSIFY in info.tasks:  # InferenceClient.token_classification
            return await self.token_classify(request, served.tokenizer)
        if info.accepts_images and present(shape.parameters):
            return await self.zero_shot_image(request)  # its zero_shot_image_classification
        kind = model_kind(info)
        if kind == "reranker":
            return await self.rerank(request)
        if kind == "classifier":
            return await self.predict(request)
        if bytes(memoryview(shape.inputs)[:1]) == b"{":
            return await self.similarity(request)  # InferenceClient.sentence_similarity
        if Task.EMBED_SPARSE in info.tasks:
            return await self.embed_sparse(request)
        return await self.embed(request)

    # embeddings -----------------------------------------------------------

    def _embed_request(
        self, body: TeiEmbed, task: Task, prefix: str, request: web.Request
    ) -> PoolRequest:
        texts = _listed(body.inputs)
        _batch(texts, "inputs", self._max_inputs)
        dimensions = body.dimensions if task is Task.EMBED else None
        return PoolRequest(
            task=task,
            params=PoolingParams(
                # TEI's embed_all returns the raw token states; embed_sparse has no switch.
                use_activation={Task.EMBED: body.normalize, Task.TOKEN_EMBED: False}.get(task),
                dimensions=dimensions,
                truncate_prompt_tokens=_truncate(body.truncate),
            ),
            request_id=request_id(request, prefix),
            model=body.model,
            texts=tuple(texts),
            prompt_name=body.prompt_name,
            truncation_side=_side(body.truncation_direction),
        )

    async def embed(self, request: web.Request) -> web.Response:
        """[[float]]: one vector per input."""
        body = await self._decode(request, TeiEmbed)
        if body.dimensions is not None and body.dimensions < 1:
            raise refused("dimensions", "must be at least 1")
        result = await self._pool(request, self._embed_request(body, Task.EMBED, "embed", request))
        rows = [output_of(output, Embedding).values for output in result.outputs]
        values = sum(row.size for row in rows)
        return await render(lambda: matrix(rows), values, self._max_bytes)

    async def embed_all(self, request: web.Request) -> web.Response:
        """[[[float]]]: one vector per token of each input. On a multi-vector (ColBERT)
        model, which has no raw token states to give, each input's ColBERT matrix, as
        embed_multi gives it: one normalised, projected row per kept token, in document
        mode unless `prompt_name` names the query mode."""
        body = await self._decode(request, TeiEmbed)
        pool = self._embed_request(body, Task.TOKEN_EMBED, "embed_all", request)
        pool = _with_budget(pool, self._max_bytes)

        def prepare(info: ModelInfo) -> PoolRequest:
            if Task.TOKEN_EMBED in info.tasks or Task.EMBED_MULTI not in info.tasks:
                return pool  # token states (or the engine's refusal)
            params = PoolingParams(truncate_prompt_tokens=pool.params.truncate_prompt_tokens)
            mode = pool.prompt_name
            colbert = isinstance(info.settings, MultiVectorSettings)
            if mode is None and colbert:  # bge-m3's matrix has no modes
                mode = "document"
            return replace(pool, task=Task.EMBED_MULTI, params=params, prompt_name=mode)

        ran = await self.runner.pool(pool, call(request, "Pool"), prepare=prepare)
        rows = [output_of(output, (TokenRows, MultiVector)).values for output in ran.result.outputs]
        values = sum(row.size for row in rows)

        def build() -> msgspec.Raw:
            # One text's floats at a time: Python floats for one matrix, never for all.
            encode = msgspec.json.encode
            return msgspec.Raw(b"[" + b",".join(encode(row.tolist()) for row in rows) + b"]")

        return await render(build, values, self._max_bytes)

    async def embed_sparse(self, request: web.Request) -> web.Response:
        """[[{index, value}]]: each input's non-zero vocabulary weights, by index."""
        body = await self._decode(request, TeiEmbed)
        pool = self._embed_request(body, Task.EMBED_SPARSE, "embed_sparse", request)
        result = await self._pool(request, pool)
        items = [output_of(output, SparseEmbedding) for output in result.outputs]

        def build() -> list[list[dict[str, Any]]]:
            rendered = []
            for item in items:
                order = np.argsort(item.indices, kind="stable")
                indices, weights = item.indices[order].tolist(), item.values[order].tolist()
                rendered.append(
                    [{"index": i, "value": v} for i, v in zip(indices, weights, strict=True)]
                )
            return rendered

        values = sum(item.indices.size for item in items)
        return await render(build, 2 * values, self._max_bytes)

    async def similarity(self, request: web.Request) -> web.Response:
        """[float]: the cosine similarity of each sentence to the source sentence, from
        their embeddings (unnormalized, as TEI computes it)."""
        body = await self._decode(request, TeiSimilarity)
        if body.inputs is None:
            raise refused("inputs", "missing; send {source_sentence, sentences}")
        sentences = body.inputs.sentences
        if not sentences:
            raise empty("inputs.sentences")
        _batch([body.inputs.source_sentence, *sentences], "inputs.sentences", self._max_inputs)
        parameters = body.parameters or SimilarityParameters()
        pool = PoolRequest(
            task=Task.EMBED,
            params=PoolingParams(
                use_activation=False, truncate_prompt_tokens=_truncate(parameters.truncate)
            ),
            request_id=request_id(request, "similarity"),
            model=body.model,
            texts=(body.inputs.source_sentence, *sentences),
            prompt_name=parameters.prompt_name,
            truncation_side=_side(parameters.truncation_direction),
        )
        result = await self._pool(request, pool)
        vectors = np.stack([output_of(output, Embedding).values for output in result.outputs])
        return json_response(cosine_to_first(vectors).tolist())

    # classifiers and rerankers --------------------------------------------

    async def predict(self, request: web.Request) -> web.Response:
        """[{score, label}] for one input (a text, or a [text, text] pair), sorted by score;
        a batch ([[text], [text, text], ...]) gets one such list each. Pairs go through
        the model's score (a cross-encoder's), single texts through classify."""
        body = await self._decode(request, TeiPredict)
        batch, single = _sequences(body.inputs)
        if not batch:
            raise empty("inputs")
        _batch([""] * len(batch), "inputs", self._max_inputs)
        hub = body.parameters
        function = None if hub is None else hub.function_to_apply
        if function is not None and function not in FUNCTIONS:
            known = ", ".join(FUNCTIONS)
            raise refused("parameters.function_to_apply", f"must be one of {known}")
        if hub is not None and hub.top_k is not None and hub.top_k < 1:
            raise refused("parameters.top_k", "must be at least 1")
        params = PoolingParams(
            # A function asked for is applied here, to the raw scores.
            use_activation=not body.raw_scores and function is None,
            truncate_prompt_tokens=_truncate(body.truncate),
        )
        side = _side(body.truncation_direction)
        singles = [i for i, sequence in enumerate(batch) if len(sequence) == 1]
        pairs = [i for i, sequence in enumerate(batch) if len(sequence) == 2]
        runs = []
        if singles:
            runs.append(
                PoolRequest(
                    task=Task.CLASSIFY,
                    params=params,
                    request_id=request_id(request, "predict"),
                    model=body.model,
                    texts=tuple(batch[i][0] for i in singles),
                    truncation_side=side,
                )
            )
        if pairs:
            runs.append(
                PoolRequest(
                    task=Task.SCORE,
                    params=params,
                    request_id=request_id(request, "predict-pairs"),
                    model=body.model,
                    text_1=tuple(batch[i][0] for i in pairs),
                    text_2=tuple(batch[i][1] for i in pairs),
                    truncation_side=side,
                )
            )
        budgeted = [_with_budget(run, self._max_bytes) for run in runs]
        rans = await asyncio.gather(*(self.runner.pool(r, call(request, "Pool")) for r in budgeted))
        results = [ran.result for ran in rans]
        info = rans[0].info  # the model as the runner resolved it: its labels
        assert info is not None
        outputs: list[Any] = [None] * len(batch)
        ordered = ([singles] if singles else []) + ([pairs] if pairs else [])
        for places, result in zip(ordered, results, strict=True):
            for place, output in zip(places, result.outputs, strict=True):
                outputs[place] = output
        predictions = [_predictions(output, info, function) for output in outputs]
        if hub is not None and hub.top_k is not None:
            predictions = [ranked[: hub.top_k] for ranked in predictions]
        if single and hub is None:  # TEI's shape; the Inference API's keeps the outer list
            return json_response(predictions[0])
        return json_response(predictions)

    async def token_classify(self, request: web.Request, tokenizer: ModelTokenizer) -> web.Response:
        """Hugging Face's token classification of a token-classification model: entities
        as transformers' pipeline groups them (service/http/entities.py), `simple` unless
        `parameters.aggregation_strategy` says otherwise; a list of texts gets a list each."""
        body = await self._decode(request, TeiTokenClassify)
        texts = _listed(body.inputs)
        _batch(texts, "inputs", self._max_inputs)
        hub = body.parameters or TokenClassificationParameters()
        aggregation = hub.aggregation_strategy or DEFAULT_AGGREGATION
        if aggregation not in AGGREGATIONS:
            known = ", ".join(AGGREGATIONS)
            raise refused("parameters.aggregation_strategy", f"must be one of {known}")
        if hub.stride is not None:
            raise refused(
                "parameters.stride",
                "is not taken: a long text follows the server's --long-input rule, or set "
                "truncate to true",
            )
        ignore = set(DEFAULT_IGNORED if hub.ignore_labels is None else hub.ignore_labels)
        pool = PoolRequest(
            task=Task.TOKEN_CLASSIFY,
            params=PoolingParams(  # the raw logits: the pipeline's softmax is applied here
                use_activation=False, truncate_prompt_tokens=_truncate(body.truncate)
            ),
            request_id=request_id(request, "token-classification"),
            model=body.model,
            texts=tuple(texts),
            truncation_side=_side(body.truncation_direction),
        )
        longest_text = max(map(len, texts), default=0)

        def prepare(info: ModelInfo) -> PoolRequest:
            # The answer is entities, not logits: counted as such before the forward pass.
            longest = max(map(len, info.labels), default=len(str(len(info.labels))))
            cap = entity_budget(self._max_bytes, "--max-http-response-mb", longest, longest_text)
            return replace(pool, response_budget=cap)

        ran = await self.runner.pool(
            _with_budget(pool, self._max_bytes), call(request, "Pool"), prepare=prepare
        )
        info, outputs = ran.info, [output_of(rows, TokenRows) for rows in ran.result.outputs]
        assert info is not None
        labels = [info.label(i) for i in range(outputs[0].values.shape[-1])]
        single = isinstance(body.inputs, str)

        def build() -> msgspec.Raw:
            # One text's entities at a time, encoded and let go: Python dicts for one
            # text's tokens, never for all.
            encode = msgspec.json.encode
            found = [
                encode(entities(text, rows, labels, tokenizer, aggregation, ignore))
                for text, rows in zip(texts, outputs, strict=True)
            ]
            return msgspec.Raw(found[0] if single else b"[" + b",".join(found) + b"]")

        # Up to six fields a token: many tokens are grouped on a worker thread.
        tokens = sum(len(rows.token_ids) for rows in outputs)
        return await render(build, 6 * tokens, self._max_bytes)

    async def zero_shot_image(self, request: web.Request) -> web.Response:
        """[{label, score}] by decreasing score: an image model's zero-shot classification
        of one image over `parameters.candidate_labels`, each in the hypothesis template
        (Hugging Face's "{}" for the label, or the server's --label-template)."""
        body = await self._decode(request, TeiZeroShotImage)
        if not body.inputs:
            raise refused("inputs", "missing; send one image as base64 or a data URL")
        hub = body.parameters or ZeroShotImageParameters()
        template = hub.hypothesis_template
        if template is not None and "{label}" not in template:
            template = template.replace("{}", "{label}")
        pool = PoolRequest(
            task=Task.CLASSIFY,
            params=PoolingParams(),
            request_id=request_id(request, "zero-shot"),
            model=body.model,
            items=(image_from_url(body.inputs, "inputs"),),
            candidate_labels=tuple(hub.candidate_labels),
            label_template=template,
        )
        [output] = (await self._pool(request, pool)).outputs
        probs = output_of(output, Classification).probs
        order = np.argsort(-probs, kind="stable")
        labels = hub.candidate_labels
        return json_response([{"label": labels[i], "score": float(probs[i])} for i in order])

    async def rerank(self, request: web.Request) -> web.Response:
        """[{index, score, text?}], best first."""
        body = await self._decode(request, TeiRerank)
        if body.query is None:
            raise refused("query", "missing; send a string")
        texts = _listed(body.texts)
        _batch(texts, "texts", self._max_inputs)
        rerank = RerankRequest(
            query=body.query,
            documents=tuple(texts),
            params=PoolingParams(
                use_activation=not body.raw_scores, truncate_prompt_tokens=_truncate(body.truncate)
            ),
            request_id=request_id(request, "rerank"),
            model=body.model,
            truncation_side=_side(body.truncation_direction),
            instruction=body.instruction,
        )
        ran = await self.runner.rerank(rerank, call(request, "Rerank"))
        ranks: list[dict[str, Any]] = []
        for ranked in ran.result.ranking:
            rank: dict[str, Any] = {"index": ranked.index, "score": ranked.score}
            if body.return_text:
                rank["text"] = texts[ranked.index]
            ranks.append(rank)
        return json_response(ranks)

    # tokenizer --------------------------------------------------------------

    async def tokenize(self, request: web.Request) -> web.Response:
        """[[{id, text, special, start, stop}]]: `text` is the input's span (character
        offsets), or the token itself for special tokens, which have no span. Laid out
        from the token arrays on the runner's worker thread (service/http/token_json.py),
        its exact size checked against the response cap first."""
        body = await self._decode(request, TeiTokenize)
        max_inputs = self.runner.limits.max_client_batch_size
        texts = _listed(body.inputs)
        _batch(texts, "inputs", max_inputs)
        cap = budget(self._max_bytes)
        ran = await self.runner.tokenize(
            body.model,
            texts,
            call(request, "Tokenize"),
            lambda tokenized: tokenize_json(tokenized, cap),
            body.add_special_tokens,
            cap,
            body.prompt_name,
        )
        return web.Response(body=ran.result, content_type="application/json")

    async def decode(self, request: web.Request) -> web.Response:
        """[str]: the text of each id sequence."""
        body = await self._decode(request, TeiDecode)
        max_inputs = self.runner.limits.max_client_batch_size
        ids = body.ids
        if ids and all(isinstance(i, int) for i in ids):
            sequences: list[list[int]] = [ids]  # type: ignore[list-item]
        elif all(isinstance(i, list) for i in ids):
            sequences = ids  # type: ignore[assignment]
        else:
            raise refused("ids", "a list of ids or a list of id lists, not both")
        if not sequences:
            raise empty("ids")
        _batch([""] * len(sequences), "ids", max_inputs)
        decoding = call(request, "Decode")
        ran = await self.runner.decode(body.model, sequences, body.skip_special_tokens, decoding)
        return json_response(ran.result)

    # info -------------------------------------------------------------------

    async def info(self, request: web.Request) -> web.Response:
        """TEI's Info for the default model (or ?model=name)."""
        engine = self.runner.ready()
        info = engine.model_named(request.query.get("model", "")).info
        batch = engine.batch_config
        return json_response(
            {
                "model_id": info.name,
                "model_sha": info.revision or None,
                "model_dtype": info.dtype,
                "served_model_name": info.name,
                "model_type": model_type(info),
                "max_concurrent_requests": batch.max_queued_items,
                "max_input_length": info.max_input_tokens,
                "max_batch_tokens": batch.max_batch_tokens,
                "max_batch_requests": batch.max_batch_size or None,
                "max_client_batch_size": engine.limits.max_client_batch_size,
                "auto_truncate": info.long_input is LongInput.TRUNCATE,
                "tokenization_workers": engine.tokenizer_threads,
                "version": server_version(),
                "sha": None,
                "docker_label": None,
                "prompts": info.prompts,
            }
        )


# ------------------------------------------------------------------- helpers


def model_kind(info: ModelInfo) -> str:
    """TEI's kinds: a cross-encoder is a reranker, another classifier head a classifier,
    everything else an embedding model."""
    if info.is_cross_encoder:
        return "reranker"
    if info.head is HeadKind.SEQUENCE or Task.TOKEN_CLASSIFY in info.tasks:
        return "classifier"
    return "embedding"


def model_type(info: ModelInfo) -> dict[str, Any]:
    kind = model_kind(info)
    if kind == "embedding":
        pooling = str(info.pooling_type)  # a SPLADE model's: "splade"
        if info.pooling_type is PoolingType.LAST:
            pooling = "last_token"
        return {"embedding": {"pooling": pooling}}
    labels = [info.label(i) for i in range(max(len(info.labels), 1))]
    return {
        kind: {
            "id2label": {str(i): label for i, label in enumerate(labels)},
            "label2id": {label: i for i, label in enumerate(labels)},
        }
    }


def cosine_to_first(vectors: np.ndarray) -> np.ndarray:
    """Cosine similarity of rows 1.. to row 0 (0 where a vector is all zeros)."""
    norms = np.linalg.norm(vectors, axis=1)
    norms = np.where(norms == 0, 1.0, norms)
    unit = vectors / norms[:, None]
    return (unit[1:] @ unit[0]).astype(np.float32)


def _sequences(inputs: str | list[Any]) -> tuple[list[list[str]], bool]:
    """TEI's PredictInput: a string, a pair [a, b] (or [a]), or a batch of [a] / [a, b]."""
    if isinstance(inputs, str):
        return [[inputs]], True
    if all(isinstance(item, str) for item in inputs):
        if not 1 <= len(inputs) <= 2:
            raise refused("inputs", "a single input is a text or a pair [text, text]")
        return [inputs], True
    if not all(isinstance(item, list) for item in inputs):
        raise refused("inputs", "a batch is a list of [text] or [text, text] lists")
    for n, item in enumerate(inputs):
        if not 1 <= len(item) <= 2:
            raise refused(f"inputs[{n}]", "must be [text] or [text, text]")
    return inputs, False


def _predictions(output: Any, info: ModelInfo, function: str | None) -> list[dict[str, Any]]:
    """Labels by score, best first; `function` (the Inference API's function_to_apply)
    applied to the raw scores the engine was asked for, where given."""
    if isinstance(output, Score):
        scores = np.array([output.value], dtype=np.float64)
    else:
        scores = output_of(output, Classification).probs.astype(np.float64)
    if function is not None:
        scores = activate(scores, FUNCTIONS[function])
    order = np.argsort(-scores, kind="stable")
    return [{"score": float(scores[i]), "label": info.label(int(i))} for i in order]


def _with_budget(request: PoolRequest, max_bytes: int) -> PoolRequest:
    return replace(request, response_budget=budget(max_bytes))
