"""The HTTP surface: OpenAI-, Cohere/Jina- and vLLM-shaped JSON over the same engine.

Each route turns its JSON into the PoolRequest the gRPC API would receive and runs it
through the same servicer path, so validation, error reasons, field paths, metrics and
spans are the gRPC ones; only the envelope differs. aiohttp serves it on the front end's
own event loop, beside grpc.aio (see README, "HTTP API", for why aiohttp).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import msgspec
import numpy as np
from aiohttp import web

from engine.errors import ErrorKind, FieldViolation, PoolingError, internal_error
from engine.output_size import MIB, ResponseBudget
from engine.validation import output_too_large, unknown_value
from service.auth import BearerKeys
from service.http_cohere import CohereRoutes
from service.http_guard import AcceptErrors, ConnectionGuard, HttpLimits
from service.http_tei import TeiRoutes
from service.json_body import Body, BodyError, parse_body
from service.proto import pooling_pb2 as pb
from service.runner import RequestRunner
from service.servicer import PoolingServicer

log = logging.getLogger(__name__)

HTTP_STATUS: dict[ErrorKind, int] = {
    ErrorKind.INVALID_ARGUMENT: 400,
    ErrorKind.NOT_FOUND: 404,
    ErrorKind.FAILED_PRECONDITION: 412,
    ErrorKind.RESOURCE_EXHAUSTED: 429,
    ErrorKind.DEADLINE_EXCEEDED: 504,
    ErrorKind.CANCELLED: 499,
    ErrorKind.UNAVAILABLE: 503,
    ErrorKind.INTERNAL: 500,
}
# OpenAI's error `type` values, which its SDK and the tools built on it read.
ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error"}
UNPROTECTED = frozenset({"/health"})
_json = msgspec.json.Encoder()

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# The largest response body (--max-http-response-mb), and what one float costs in it: a
# float32 printed as the shortest double that reads back takes about 21 characters with its
# comma; in base64 (encoding_format) 4 bytes take 5.33.
MAX_RESPONSE_BYTES = 64 * MIB
JSON_FLOAT_BYTES = 21
BASE64_FLOAT_BYTES = 6
# Answers of more values are rendered to JSON off the event loop (100k take about 10 ms).
OFF_LOOP_VALUES = 100_000
# Also the most connections asyncio accepts in one go, each a descriptor before the cap
# sees it: the cap leaves half the open-file limit, far more than this, to the rest.
LISTEN_BACKLOG = 128


class HttpApi:
    def __init__(
        self,
        servicer: PoolingServicer,
        api_keys: Sequence[str] = (),
        runner: RequestRunner | None = None,
    ) -> None:
        self.servicer = servicer
        self.runner = runner or RequestRunner(servicer.telemetry)
        self._keys = BearerKeys(api_keys)  # service/auth.py: the check every door makes
        self._created = int(time.time())
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.AbstractServer | None = None
        self.guard: ConnectionGuard | None = None
        self.serving = False  # follows the gRPC health status
        self.max_response_bytes = MAX_RESPONSE_BYTES  # --max-http-response-mb
        self.cohere_prompts: dict[str, tuple[str, ...]] | None = None  # None: the defaults

    def app(
        self, max_body: int = 16 * 1024 * 1024, guard: ConnectionGuard | None = None
    ) -> web.Application:
        """`max_body`: the largest request body, as --max-message-mb bounds a gRPC message.
        `guard`: its header timer stops first; bodies are read at its pace after auth."""
        middlewares = [self._guard]
        if guard is not None:
            middlewares = [guard.track, self._guard, guard.read_body]
        app = web.Application(middlewares=middlewares, client_max_size=max_body)
        # TEI's and Cohere's routes (service/http_tei.py, http_cohere.py): /rerank is
        # both TEI's ({query, texts}) and Cohere/Jina's ({query, documents}), by body shape.
        tei = TeiRoutes(self)
        post = [
            ("/v1/embeddings", self.embeddings),
            ("/v1/rerank", self.rerank),
            ("/rerank", tei.rerank_or(self.rerank)),
            ("/v1/score", self.score),
            ("/score", self.score),
            ("/pooling", self.pooling),
            ("/classify", self.classify),
        ]
        app.add_routes([web.post(path, handler) for path, handler in post])
        app.add_routes([web.get("/v1/models", self.models), web.get("/health", self.health)])
        app.add_routes(tei.routes() + CohereRoutes(self, self.cohere_prompts).routes())
        return app

    async def start(
        self,
        host: str,
        port: int,
        reuse_port: bool,
        max_body: int,
        limits: HttpLimits | None = None,
    ) -> int:
        """Listen; returns the port (the one chosen, when `port` is 0).

        The listener is ours rather than a TCPSite's, so that every connection goes through
        the guard (service/http_guard.py): capped, header-timed, bodies paced."""
        limits = limits or HttpLimits()
        loop = asyncio.get_running_loop()
        AcceptErrors(loop)
        self.guard = ConnectionGuard(limits, _error_response)
        # A client that goes away cancels its handler, which drops its queued items.
        self._runner = web.AppRunner(
            self.app(max_body, self.guard),
            handler_cancellation=True,
            access_log=None,
            keepalive_timeout=limits.keepalive_timeout_s,
        )
        await self._runner.setup()
        assert self._runner.server is not None
        self._listener = await loop.create_server(
            self.guard.factory(self._runner.server),
            host,
            port,
            backlog=LISTEN_BACKLOG,
            reuse_port=reuse_port or None,
        )
        return int(self._listener.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        """Stop accepting, then let aiohttp finish (or close) the open connections."""
        if self._listener is not None:
            self._listener.close()
        if self._runner is not None:
            await self._runner.cleanup()

    # ----------------------------------------------------------------- middleware

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Bearer keys before anything is read; every failure as one JSON error shape."""
        if self._keys and request.path not in UNPROTECTED and not self._authorized(request):
            return _error_response(401, "UNAUTHENTICATED", "missing or invalid credentials")
        try:
            return await handler(request)
        except PoolingError as error:
            return _pooling_error(error)
        except BodyError as error:
            v = error.violation
            return _error_response(422, v.reason, f"{v.field}: {v.description}", [v])
        except web.HTTPException as exc:
            return _error_response(exc.status, exc.reason.upper().replace(" ", "_"), exc.text)
        except Exception:
            log.exception("HTTP %s %s failed", request.method, request.path)
            return _pooling_error(internal_error())

    def _authorized(self, request: web.Request) -> bool:
        return self._keys.allow(request.headers.get("Authorization"))

    # --------------------------------------------------------------------- routes

    async def embeddings(self, request: web.Request) -> web.Response:
        """OpenAI's POST /v1/embeddings."""
        body = await self._body(request)
        texts = _texts(body, "input")
        fmt = _string(body, "encoding_format", "float")
        if fmt not in ("float", "base64"):
            raise unknown_value("encoding_format", fmt)
        params = pb.PoolingParams()
        if body.has("dimensions"):
            params.dimensions = _int(body, "dimensions")
        message = pb.PoolRequest(
            request_id=_request_id(request, "embd"),
            model=_string(body, "model", ""),
            params=params,
            embed=pb.TextInput(texts=texts),
        )
        response = await self._pool(
            request, message, BASE64_FLOAT_BYTES if fmt == "base64" else JSON_FLOAT_BYTES
        )

        def build() -> dict[str, Any]:
            data = []
            for index, embedding in enumerate(response.embed.embeddings):
                values: Any = list(embedding.values)
                if fmt == "base64":
                    raw = np.asarray(embedding.values, dtype="<f4").tobytes()
                    values = base64.b64encode(raw).decode()
                data.append({"object": "embedding", "index": index, "embedding": values})
            return {
                "object": "list",
                "data": data,
                "model": response.model,
                "usage": _usage(response),
            }

        return await self._render(build, _values(response))

    async def score(self, request: web.Request) -> web.Response:
        """vLLM's POST /v1/score: text_1 and text_2, each a string or a list."""
        body = await self._body(request)
        message = pb.PoolRequest(
            request_id=_request_id(request, "score"),
            model=_string(body, "model", ""),
            params=_params(body),
            score=pb.ScoreInput(text_1=_texts(body, "text_1"), text_2=_texts(body, "text_2")),
        )
        response = await self._pool(request, message)
        data = [
            {"index": i, "object": "score", "score": score}
            for i, score in enumerate(response.score.scores)
        ]
        return _ok(_listing(message.request_id, response, data))

    async def classify(self, request: web.Request) -> web.Response:
        """vLLM's POST /classify."""
        body = await self._body(request)
        message = pb.PoolRequest(
            request_id=_request_id(request, "classify"),
            model=_string(body, "model", ""),
            params=_params(body),
            classify=pb.TextInput(texts=_texts(body, "input")),
        )
        response = await self._pool(request, message)
        data = [
            {
                "index": i,
                "label": item.label,
                "probs": list(item.probs),
                "num_classes": len(item.probs),
            }
            for i, item in enumerate(response.classify.classifications)
        ]
        return _ok(_listing(message.request_id, response, data))

    async def pooling(self, request: web.Request) -> web.Response:
        """vLLM's POST /pooling: any task; `data` is a vector (or a row per token)."""
        body = await self._body(request)
        task = _string(body, "task", "embed")
        if task not in ("embed", "classify", "token_embed", "token_classify"):
            raise unknown_value("task", task)
        params = _params(body)
        if body.has("dimensions"):
            params.dimensions = _int(body, "dimensions")
        message = pb.PoolRequest(
            request_id=_request_id(request, "pool"), model=_string(body, "model", ""), params=params
        )
        getattr(message, task).texts.extend(_texts(body, "input"))
        response = await self._pool(request, message)

        def build() -> dict[str, Any]:
            rows: list[Any]
            if task == "embed":
                rows = [list(e.values) for e in response.embed.embeddings]
            elif task == "classify":
                rows = [list(c.probs) for c in response.classify.classifications]
            else:
                items = getattr(response, task).items
                rows = [
                    np.asarray(m.values, dtype=np.float32).reshape(m.rows, m.cols).tolist()
                    for m in items
                ]
            data = [{"index": i, "object": "pooling", "data": row} for i, row in enumerate(rows)]
            return _listing(message.request_id, response, data)

        return await self._render(build, _values(response))

    async def rerank(self, request: web.Request) -> web.Response:
        """The Cohere/Jina shape that vLLM and Infinity serve at /v1/rerank and /rerank."""
        body = await self._body(request)
        texts = body.documents()
        if not body.has("query"):
            raise BodyError("query", "must be a string")
        query = _string(body, "query", "")
        top_n = _int(body, "top_n") if body.has("top_n") else 0
        return_documents = bool(body.boolean("return_documents"))  # Cohere's default: false
        message = pb.RerankRequest(
            request_id=_request_id(request, "rerank"),
            model=_string(body, "model", ""),
            query=query,
            documents=texts,
            top_n=top_n,
            return_documents=return_documents,
            params=_params(body),
        )
        record = self.servicer.telemetry.begin("Rerank", message, _Caller(request), "http")
        response = await self.servicer.run_rerank(message, record, None, _client(request))
        results = []
        for result in response.results:
            item: dict[str, Any] = {
                "index": result.index,
                "relevance_score": result.relevance_score,
            }
            if result.HasField("document"):
                item["document"] = {"text": result.document}
            results.append(item)
        return _ok(
            {
                "id": message.request_id,
                "model": response.model,
                "results": results,
                "usage": _usage(response),
            }
        )

    async def models(self, request: web.Request) -> web.Response:
        engine = self.servicer._ready_engine()
        data = [
            {
                "id": info.name,
                "object": "model",
                "created": self._created,
                "owned_by": "pooling-server",
                "max_model_len": info.max_input_tokens,
                "tasks": [str(task) for task in info.tasks],
                "backend": info.backend,
                "precision": info.precision,
            }
            for info in engine.model_infos
        ]
        return _ok({"object": "list", "data": data})

    async def health(self, request: web.Request) -> web.Response:
        if self.serving:
            return _ok({"status": "SERVING"})
        return _ok({"status": "NOT_SERVING"}, status=503)

    async def _body(self, request: web.Request) -> Body:
        """The body, its input lists counted against --max-client-batch-size as read."""
        engine = self.servicer._ready_engine()
        return await _read_body(request, engine.limits.max_client_batch_size)

    async def _pool(
        self, request: web.Request, message: pb.PoolRequest, float_bytes: int = JSON_FLOAT_BYTES
    ) -> pb.PoolResponse:
        """`float_bytes`: what one output value costs in the route's JSON, for the budget."""
        record = self.servicer.telemetry.begin("Pool", message, _Caller(request), "http")
        budget = self.budget(float_bytes)
        return await self.servicer.run_pool(message, record, None, _client(request), budget)

    def budget(self, float_bytes: int = JSON_FLOAT_BYTES) -> ResponseBudget:
        """The engine's bound on an answer sent as JSON: values only, no compact encodings."""
        return ResponseBudget(
            max_bytes=self.max_response_bytes,
            setting="--max-http-response-mb",
            float_bytes=float_bytes,
            item_bytes=64,  # {"index": ..., "object": ..., "data": [...]}
            row_bytes=3,  # a token row's brackets and comma
            encodings=False,
        )

    async def _render(self, build: Callable[[], dict[str, Any]], values: int) -> web.Response:
        """A 200 JSON body. One of many values is built and encoded on a worker thread, so
        the event loop serves other connections meanwhile; one over the cap is refused
        (the estimate let it through: a safety net, not the rule)."""
        if values > OFF_LOOP_VALUES:
            body = await asyncio.to_thread(lambda: _json.encode(build()))
        else:
            body = _json.encode(build())
        if len(body) > self.max_response_bytes:
            raise output_too_large("", len(body), self.budget())
        return web.Response(body=body, content_type="application/json")


class _Caller:
    """What telemetry reads from a gRPC context, from an HTTP request: its headers (the
    caller's W3C traceparent among them)."""

    def __init__(self, request: web.Request) -> None:
        self._headers = request.headers

    def invocation_metadata(self) -> Iterable[tuple[str, str]]:
        return [(key.lower(), value) for key, value in self._headers.items()]


# ------------------------------------------------------------------ body helpers


# Bodies larger than this are decoded on a worker thread. The decoding is bounded either
# way (service/json_body.py); this keeps even that off the event loop.
OFF_LOOP_BODY_BYTES = 1024 * 1024


async def _read_body(request: web.Request, max_inputs: int) -> Body:
    raw = await request.read()
    if len(raw) > OFF_LOOP_BODY_BYTES:
        return await asyncio.to_thread(parse_body, raw, max_inputs)
    return parse_body(raw, max_inputs)


def _texts(body: Body, field: str) -> list[str]:
    return body.texts(field)


def _string(body: Body, field: str, default: str) -> str:
    return body.string(field, default)


def _int(body: Body, field: str) -> int:
    """A present integer field, range-checked against its wire type (int32)."""
    value = body.integer(field)
    assert value is not None  # the routes read present fields only
    return value


def _params(body: Body) -> pb.PoolingParams:
    """vLLM's request-level pooling fields: use_activation (or its older name softmax /
    normalize) and truncate_prompt_tokens."""
    params = pb.PoolingParams()
    for name in ("use_activation", "softmax", "normalize", "activation"):
        value = body.boolean(name)
        if value is not None:
            params.use_activation = value
            break
    if body.has("truncate_prompt_tokens"):
        params.truncate_prompt_tokens = _int(body, "truncate_prompt_tokens")
    return params


def _values(response: pb.PoolResponse) -> int:
    """How many float values an answer carries: what its JSON costs to build."""
    case = response.WhichOneof("output")
    if case == "embed":
        return sum(len(e.values) for e in response.embed.embeddings)
    if case == "classify":
        return sum(len(c.probs) for c in response.classify.classifications)
    if case in ("token_embed", "token_classify"):
        return sum(m.rows * m.cols for m in getattr(response, case).items)
    return 0


def _client(request: web.Request) -> str:
    """The queue's client: the peer address (not the port: HTTP/1.1 clients open several
    connections), so one address cannot take the whole queue."""
    return request.remote or "unknown"


def _request_id(request: web.Request, prefix: str) -> str:
    given = request.headers.get("X-Request-Id")
    if not given:
        return f"{prefix}-{uuid.uuid4().hex}"
    try:
        given.encode()
    except UnicodeEncodeError:  # bytes that are not UTF-8, read by aiohttp as surrogates
        raise _invalid(
            "X-Request-Id", "must be UTF-8 text (it becomes the request_id)", "REQUEST_ID_INVALID"
        ) from None
    return given


def _invalid(field: str, description: str, reason: str) -> PoolingError:
    return PoolingError.invalid([FieldViolation(field, description, reason)])


def _usage(response: pb.PoolResponse | pb.RerankResponse) -> dict[str, int]:
    tokens = response.usage.prompt_tokens
    return {"prompt_tokens": tokens, "total_tokens": tokens}


def _listing(request_id: str, response: pb.PoolResponse, data: list[Any]) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "list",
        "created": int(time.time()),
        "model": response.model,
        "data": data,
        "usage": _usage(response),
    }


def _ok(payload: dict[str, Any], status: int = 200) -> web.Response:
    return web.Response(body=_json.encode(payload), status=status, content_type="application/json")


def _pooling_error(error: PoolingError) -> web.Response:
    status = HTTP_STATUS[error.kind]
    response = _error_response(
        status, error.reason, error.message, error.violations, error.metadata, error.retry_after_s
    )
    if error.retry_after_s is not None and status in (429, 503):
        response.headers["Retry-After"] = str(max(1, round(error.retry_after_s)))
    return response


def _error_response(
    status: int,
    reason: str,
    message: str,
    violations: Sequence[FieldViolation] = (),
    metadata: dict[str, str] | None = None,
    retry_after_s: float | None = None,
) -> web.Response:
    """OpenAI's error envelope (message, type, param, code), plus the gRPC details:
    the reason, every field violation and the retry delay."""
    error: dict[str, Any] = {
        "message": message,
        "type": ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request"),
        "param": violations[0].field if violations else None,
        "code": reason,
        "reason": reason,
        "field_violations": [
            {"field": v.field, "description": v.description, "reason": v.reason} for v in violations
        ],
    }
    if metadata:
        error["metadata"] = metadata
    if retry_after_s is not None:
        error["retry_after_s"] = retry_after_s
    return _ok({"error": error}, status=status)
