"""The HTTP surface: OpenAI-, Cohere/Jina- and vLLM-shaped JSON over the same engine.

The OpenAI/vLLM routes are thin adapters over service/http/openai.py's table, the one offline
batch jobs use: read the body (service/http/json_body.py), parse it into an engine request,
run it through the RequestRunner (readiness, telemetry, deadlines, the queue's fairness
by client address) and render the engine's arrays as JSON, so an HTTP answer and a batch
line's answer are made by the same code. TEI's and Cohere's doors (service/http/tei.py,
service/http/cohere.py) hang off the same app. aiohttp serves it on the front end's own
event loop, beside grpc.aio (see README, "HTTP API", for why aiohttp).

Every failure, whichever route family it came through, leaves by one middleware (`_guard`),
which renders it from service/errors.py in the family's envelope, and counts in the
metrics the refusals the door made itself (the runner counts the rest).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgspec
from aiohttp import HttpVersion11, web

from pooling_server.engine.errors import ErrorKind, PoolingError, internal_error
from pooling_server.engine.requests.output_size import ResponseBudget
from pooling_server.engine.requests.outputs import values_in
from pooling_server.engine.scheduling.engine import Engine
from pooling_server.service.errors import Family, FieldMap, from_http, http_error
from pooling_server.service.http import door as http_doors
from pooling_server.service.http import openapi, repository, tei
from pooling_server.service.http.cohere import (
    COHERE_BODIES,
    COHERE_FIELDS,
    COHERE_RPCS,
    CohereRoutes,
)
from pooling_server.service.http.door import (
    COUNTED,
    FAMILY,
    JSON_FLOAT_BYTES,
    MAX_RESPONSE_BYTES,
    REQUEST_ID,
)
from pooling_server.service.http.guard import (
    AcceptErrors,
    ClientFaults,
    ConnectionGuard,
    HttpLimits,
    declares_too_much,
)
from pooling_server.service.http.openai import ROUTES, Route
from pooling_server.service.ops.auth import BearerKeys
from pooling_server.service.ops.memory import trimmer
from pooling_server.service.ops.version import server_version
from pooling_server.service.runner import RequestRunner

log = logging.getLogger(__name__)

UNPROTECTED = frozenset({"/health"})
_json = msgspec.json.Encoder()

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# Each family's names for the engine's fields (the OpenAI/vLLM routes show the engine's).
FIELD_MAPS = {Family.TEI: tei.TEI_FIELDS, Family.COHERE: COHERE_FIELDS}
# A route's own names for the engine's fields, where its parse gave some (Parsed.names).
ROUTE_FIELDS = web.RequestKey("route_fields", FieldMap)
UNAUTHENTICATED = PoolingError(
    ErrorKind.UNAUTHENTICATED, "UNAUTHENTICATED", "missing or invalid credentials"
)
# Also the most connections asyncio accepts in one go, each a descriptor before the cap
# sees it: the cap leaves half the open-file limit, far more than this, to the rest.
LISTEN_BACKLOG = 128
# How long aiohttp waits for a handler it cancels at the end of the drain's grace.
CUT_WAIT_S = 1.0


class HttpApi:
    def __init__(self, runner: RequestRunner, api_keys: Sequence[str] = ()) -> None:
        self.runner = runner
        self._keys = BearerKeys(api_keys)  # service/ops/auth.py: the check every door makes
        self._created = int(time.time())
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.AbstractServer | None = None
        self.guard: ConnectionGuard | None = None
        self.serving = False  # follows the gRPC health status
        self.max_response_bytes = MAX_RESPONSE_BYTES  # --max-http-response-mb
        self.cohere_prompts: dict[str, tuple[str, ...]] | None = None  # None: the defaults
        # Each route's family (its errors' envelope) and operation (its metrics' rpc).
        self._families: dict[str, Family] = {}
        self._rpcs: dict[str, str] = {path: route.rpc for path, route in ROUTES.items()}
        self._rpcs["/v1/models"] = "ListModels"
        self._paths: dict[str, dict[str, tuple[type, ...]]] = {}  # what /openapi.json lists
        self._openapi: bytes | None = None
        # --admin-key: the /v2/repository routes are served, and open to these keys only.
        self.admin_keys: Sequence[str] = ()

    def app(
        self, max_body: int = 16 * 1024 * 1024, guard: ConnectionGuard | None = None
    ) -> web.Application:
        """`max_body`: the largest request body, as --max-message-mb bounds a gRPC message.
        `guard`: its header timer stops first; bodies are read at its pace after auth."""
        middlewares = [self._guard]
        if guard is not None:
            middlewares = [guard.track, self._guard, guard.read_body]
        app = web.Application(middlewares=middlewares, client_max_size=max_body)
        # TEI's and Cohere's routes (service/http/tei.py, http_cohere.py): /rerank is
        # both TEI's ({query, texts}) and Cohere/Jina's ({query, documents}), by body shape.
        tei_routes = tei.TeiRoutes(self)
        post = {path: self.handler(route) for path, route in ROUTES.items()}
        post["/rerank"] = tei_routes.rerank_or(post["/rerank"])
        routes = [web.post(path, handler) for path, handler in post.items()]
        routes += [web.get("/v1/models", self.models), web.get("/health", self.health)]
        routes.append(web.get("/openapi.json", self.openapi))
        if self.admin_keys:  # service/http/repository.py: Triton's routes
            routes += repository.RepositoryRoutes(self.runner).routes()
        for family, family_routes, rpcs in (
            (Family.TEI, tei_routes.routes(), tei.TEI_RPCS),
            (Family.COHERE, CohereRoutes(self, self.cohere_prompts).routes(), COHERE_RPCS),
        ):
            routes += family_routes
            for route in family_routes:
                self._families[route.path] = family
                self._rpcs[route.path] = rpcs.get(route.path, "unknown")
        self._paths = _paths(routes)
        app.add_routes(
            [
                web.RouteDef(
                    d.method, d.path, d.handler, {**d.kwargs, "expect_handler": self._expect}
                )
                for d in routes
            ]
        )
        return app

    async def _expect(self, request: web.Request) -> None:
        """`Expect: 100-continue` is answered only for a body the server would read: a
        client without a valid key, or one declaring a body over the limit, gets its
        refusal from the middlewares instead, before it sends the body."""
        expect = request.headers.get("Expect", "")
        if request.version != HttpVersion11:
            return
        if expect.lower() != "100-continue":
            raise web.HTTPExpectationFailed(text=f"unknown Expect: {expect[:64]}")
        if self._refused(request) or declares_too_much(request):
            return
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the answer proper has not started

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
        the guard (service/http/guard.py): capped, header-timed, bodies paced."""
        limits = limits or HttpLimits()
        loop = asyncio.get_running_loop()
        AcceptErrors(loop)
        ClientFaults.install()
        self.guard = ConnectionGuard(limits, _error_response, after_large=trimmer())
        # A client that goes away cancels its handler, which drops its queued items.
        self._runner = web.AppRunner(
            self.app(max_body, self.guard),
            handler_cancellation=True,
            access_log=None,
            keepalive_timeout=limits.keepalive_timeout_s,
            # stop() waits out the grace itself; aiohttp's own wait (60 s) would add to it
            shutdown_timeout=CUT_WAIT_S,
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

    async def stop(self, grace: float) -> bool:
        """Stop accepting, let running requests finish for up to `grace` seconds, then
        close every connection. True when requests were still running: they are cut."""
        if self._listener is not None:
            self._listener.close()
        if self._runner is not None and self._runner.server is not None:
            self._runner.server.pre_shutdown()  # no new request on a kept-alive connection
        cut = self.guard is not None and not await self.guard.finished(grace)
        if self._runner is not None:
            await self._runner.cleanup()
        return cut

    # ----------------------------------------------------------------- middleware

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Bearer keys before anything is read; every failure, from any route family, in
        that family's envelope (service/errors.py), and counted once."""
        request[FAMILY] = self._families.get(request.path, Family.OPENAI)
        # Each failure is answered inside its except block: an exception kept in a local
        # would hold, through its traceback's frames, the request's body (16 MB) until the
        # cyclic collector ran.
        try:
            if self._refused(request):
                raise UNAUTHENTICATED
            return await handler(request)
        except PoolingError as error:
            return self._refusal(request, error)
        except web.HTTPException as exc:  # no route, a wrong method, a body over the limit
            return self._refusal(request, from_http(exc.status, exc.reason, exc.text or exc.reason))
        except Exception:
            log.exception("HTTP %s %s failed", request.method, request.path)
            return self._refusal(request, internal_error())

    def _refusal(self, request: web.Request, error: PoolingError) -> web.Response:
        """The error in its family's envelope. One the runner did not count (a door's
        refusal: a body it could not read, a field it refused, a missing key) is counted and
        logged here, as the runner would: labelled with the route's operation and protocol,
        the status sent, model unknown."""
        response = _error_response(request, error)
        counted = request.pop(COUNTED, ())  # the runner's errors, let go with their tracebacks
        if not any(seen is error for seen in counted):
            rpc = self._rpcs.get(request.path, "unknown")
            record = self.runner.telemetry.open(
                rpc, request.get(REQUEST_ID, ""), "none", (), "http"
            )
            record.finish(str(response.status), "unknown", reason=error.reason, ok=False)
        return response

    def _refused(self, request: web.Request) -> bool:
        """A protected route without a valid key: answered 401 before anything is read.
        The repository's routes take the admin key, never an API key."""
        if self.admin_keys and (
            request.path.startswith(repository.PREFIX) or request.path in repository.LORA_ROUTES
        ):
            return not BearerKeys(self.admin_keys).allow(request.headers.get("Authorization"))
        if not self._keys or request.path in UNPROTECTED:
            return False
        return not self._keys.allow(request.headers.get("Authorization"))

    # --------------------------------------------------------------------- routes

    def handler(self, route: Route) -> Handler:
        """The HTTP door of one entry of service/http/openai.py: its body decoded as its
        declared type, parsed, run by the runner operation picked here once, rendered."""
        run = route.operation(self.runner)

        async def handle(request: web.Request) -> web.Response:
            limits = self.runner.limits  # readiness is the runner's, at the call
            body = await http_doors.read_body(request, route.body, limits.max_client_batch_size)
            parsed = route.parse(body, http_doors.request_id(request, route.prefix))
            if parsed.names is not None:
                request[ROUTE_FIELDS] = parsed.names
            parsed = parsed.budgeted(self.budget(parsed.float_bytes))
            ran = await run(parsed.request, http_doors.call(request, route.rpc))
            result = ran.result
            if parsed.binary:  # vLLM's bytes: a BinaryAnswer
                answer = parsed.render(result)
                max_bytes = self.max_response_bytes
                return http_doors.binary_response(answer.parts, answer.metadata, max_bytes)
            return await http_doors.render(
                lambda: parsed.render(result), values_in(result), self.max_response_bytes
            )

        return handle

    async def models(self, request: web.Request) -> web.Response:
        """OpenAI's model list, through the runner like every other call."""

        def render(engine: Engine) -> dict[str, Any]:
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
            # LoRA adapters after the models, each with its parent, as vLLM lists them.
            cards = {model["id"]: model for model in data}
            data += [
                {**cards[parent], "id": name, "parent": parent}
                for name, parent in sorted(engine.adapters.items())
                if parent in cards
            ]
            return {"object": "list", "data": repository.with_states(data, self.runner.repository)}

        ran = await self.runner.models(http_doors.call(request, "ListModels"), render)
        return _ok(ran.result)

    async def openapi(self, request: web.Request) -> web.Response:
        """The OpenAPI 3.1 document of every route this app serves, with each body's JSON
        Schema from its declared type (service/http/openapi.py); made once."""
        if self._openapi is None:
            self._openapi = _json.encode(openapi.document(self._paths, server_version()))
        return web.Response(body=self._openapi, content_type="application/json")

    async def health(self, request: web.Request) -> web.Response:
        if self.serving:
            return _ok({"status": "SERVING"})
        return _ok({"status": "NOT_SERVING"}, status=503)

    def budget(self, float_bytes: int = JSON_FLOAT_BYTES) -> ResponseBudget:
        """The engine's bound on an OpenAI/vLLM answer (service/http/door.py's budget)."""
        return http_doors.budget(self.max_response_bytes, float_bytes, item_bytes=64)


# ------------------------------------------------------------------ helpers

# The body types of each POST route of the OpenAI/vLLM, TEI and Cohere families (several:
# the body picks the route's shape), for /openapi.json.
BODIES: dict[str, tuple[type, ...]] = {
    **{path: (route.body,) for path, route in ROUTES.items()},
    **tei.TEI_BODIES,
    **COHERE_BODIES,
    "/rerank": (ROUTES["/rerank"].body, tei.TeiRerank),  # Cohere/Jina's shape, or TEI's
}


def _paths(routes: Sequence[web.RouteDef]) -> dict[str, dict[str, tuple[type, ...]]]:
    """path -> method -> body types, for every route served (GET routes take none)."""
    paths: dict[str, dict[str, tuple[type, ...]]] = {}
    for route in routes:
        bodies = BODIES.get(route.path, ()) if route.method == "POST" else ()
        paths.setdefault(route.path, {})[route.method] = bodies
    return paths


def _ok(payload: dict[str, Any], status: int = 200) -> web.Response:
    return web.Response(body=_json.encode(payload), status=status, content_type="application/json")


def _error_response(request: web.Request, error: PoolingError) -> web.Response:
    """`error` in the envelope of the request's route family (OpenAI's where none matched),
    from service/errors.py; also the guard's refusals (service/http/guard.py)."""
    family = request.get(FAMILY, Family.OPENAI)
    names = request.get(ROUTE_FIELDS) or FIELD_MAPS.get(family)
    return _pooling_error(error, family, names, request.get(REQUEST_ID, ""))


def _pooling_error(
    error: PoolingError,
    family: Family = Family.OPENAI,
    names: FieldMap | None = None,
    request_id: str = "",
) -> web.Response:
    answer = http_error(error, family, names, request_id)
    response = _ok(answer.body, status=answer.status)
    response.headers.update(answer.headers)
    return response
