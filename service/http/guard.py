"""The HTTP door's defences against clients that hold connections rather than send requests.

aiohttp alone bounds a request's size but not its time: headers may trickle in forever, a
body may stall after its first megabytes (holding them), an idle keep-alive connection lives
an hour, and nothing caps how many connections are open. This module adds, each from a flag
(HttpLimits, in service/ops/config.py):

- a header timeout: from the connection's start, or from the first byte of each later
  request, to the end of its headers;
- a body rate: every `body_timeout_s` window must bring `body_min_bytes_per_s` times as many
  bytes, until the body is complete; a Content-Length above the body limit is refused unread;
- at most `max_concurrent_bodies` bodies read at once (a partial body is memory held), and
  of them one large body (LARGE_MESSAGE_BYTES or more declared, or a length not known
  before it is read: chunked or compressed), read into one buffer that the route parses
  in place, its turns held until it has (then malloc_trim); waiting longer than
  `body_timeout_s` for a turn is refused with 503;
- aiohttp's keep-alive timeout, from seconds rather than an hour;
- at most `max_connections` open connections, and never more than half the open-file limit,
  so that the gRPC door always has descriptors left; a connection over the cap is answered
  503 and closed at once;
- of them, at most `max_connections_per_address` from one client address (a quarter of the
  cap unless given), so that one client's sockets lock no other client out; one over its
  address's share is answered 503 and closed at once.

A connection closed for time gets 408 and Connection: close, then the socket goes.
"""

from __future__ import annotations

import asyncio
import http
import logging
import resource
import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

import msgspec
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from pooling_server.engine.errors import ErrorKind, PoolingError
from pooling_server.service.errors import http_error
from pooling_server.service.ops.config import (
    HTTP_DESCRIPTOR_SHARE,
    LARGE_MESSAGE_BYTES,
    HttpLimits,
    address_share,
    descriptor_budget,
)

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
BODY = web.RequestKey("body", bytearray)  # a body the guard read (see _read_whole)
# A large body's read turns, held until its route has parsed it (see _read_paced)
HELD_TURNS = web.RequestKey("held_turns", list[asyncio.Semaphore])
# The app's rendering of a refusal in the request's route family (service/http/app.py).
ErrorFactory = Callable[[web.Request, PoolingError], web.Response]


def _raw_answer(error: PoolingError, with_body: bool = True) -> bytes:
    """An answer written on the socket before aiohttp reads the request (so before any
    route, in OpenAI's envelope), its status from the errors table; `with_body`: with its
    headers (Retry-After) and JSON body, else the status alone."""
    answer = http_error(error)
    phrase = http.HTTPStatus(answer.status).phrase
    head = f"HTTP/1.1 {answer.status} {phrase}\r\nConnection: close\r\n"
    if not with_body:
        return f"{head}Content-Length: 0\r\n\r\n".encode()
    head += "".join(f"{name}: {value}\r\n" for name, value in answer.headers.items())
    body = msgspec.json.encode(answer.body)
    head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


# A refused connection's answer, sent before its request is read; a connection whose
# headers come too slowly gets the status alone.
_OVER_CAP = _raw_answer(
    PoolingError(
        ErrorKind.UNAVAILABLE, "TOO_MANY_CONNECTIONS", "too many open connections", retry_after_s=1
    )
)
_OVER_ADDRESS_CAP = _raw_answer(
    PoolingError(
        ErrorKind.UNAVAILABLE,
        "TOO_MANY_CONNECTIONS",
        "too many open connections from this address",
        retry_after_s=1,
    )
)
_HEADER_TIMEOUT = _raw_answer(
    PoolingError(ErrorKind.DEADLINE_EXCEEDED, "BODY_TIMEOUT", "headers too slow"), False
)
ABORT_AFTER_S = 1.0  # a closed socket whose answer the client does not read is reset then
LOG_EVERY_S = 10.0  # one line per this many seconds for refusals that come in floods


class RateLimitedLog:
    """A warning that may come thousands of times a second: the first, then a count per period."""

    def __init__(self, message: str, every_s: float = LOG_EVERY_S) -> None:
        self.message = message
        self.every_s = every_s
        self.total = 0
        self._since = 0
        self._last = -float("inf")

    def hit(self, *args: object) -> None:
        self.total += 1
        self._since += 1
        now = time.monotonic()
        if now - self._last < self.every_s:
            return
        repeated = self._since - 1
        suffix = f" ({repeated} more since the last such line)" if repeated else ""
        log.warning(self.message + suffix, *args)
        self._last = now
        self._since = 0


class _OverCap(asyncio.Protocol):
    """A connection beyond the cap: answered 503 at once and closed, its request unread."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses: a cast, not a check.
        stream = cast(asyncio.Transport, transport)
        stream.write(_OVER_CAP)
        _close(stream)

    def data_received(self, data: bytes) -> None:
        pass


def _close(transport: asyncio.BaseTransport) -> None:
    """Close after what is written is sent; reset if the peer will not take it."""
    transport.close()
    asyncio.get_running_loop().call_later(ABORT_AFTER_S, transport.abort)  # type: ignore[attr-defined]


class _Guarded(asyncio.Protocol):
    """aiohttp's protocol for one connection, with the header timer around it.

    Every asyncio callback is passed on unchanged; the timer starts when the connection is
    made and at the first byte after a request was handled, and stops when aiohttp hands a
    request (its headers complete) to the application.
    """

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol) -> None:
        self.guard = guard
        self.inner = inner
        self.transport: asyncio.Transport | None = None
        self.in_request = False
        self._timer: asyncio.TimerHandle | None = None
        self.address = ""
        self.refused = False  # over its address's share: answered 503, aiohttp never saw it

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # see _OverCap's
        peer = transport.get_extra_info("peername")
        self.address = peer[0] if isinstance(peer, tuple) and peer else ""
        if not self.guard.opened(self):
            self.refused = True
            self.transport.write(_OVER_ADDRESS_CAP)
            _close(self.transport)
            return
        self.inner.connection_made(transport)
        self._start_timer()

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        if not self.in_request and self._timer is None:
            self._start_timer()
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        if self.refused:
            return None
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        if not self.refused:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if not self.refused:
            self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        self.guard.closed(self)
        if not self.refused:
            self.inner.connection_lost(exc)

    def request_began(self) -> None:
        self.in_request = True
        self._stop_timer()

    def request_ended(self) -> None:
        self.in_request = False

    def _start_timer(self) -> None:
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self.guard.limits.header_timeout_s, self._headers_late)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _headers_late(self) -> None:
        self._timer = None
        if self.in_request or self.transport is None or self.transport.is_closing():
            return
        log.debug(
            "HTTP headers not complete within %.1fs: closing", self.guard.limits.header_timeout_s
        )
        self.guard.header_timeouts += 1
        self.transport.write(_HEADER_TIMEOUT)
        _close(self.transport)


class ConnectionGuard:
    """Counts and caps the door's connections, times their headers, paces their bodies."""

    def __init__(
        self,
        limits: HttpLimits,
        error: ErrorFactory,
        after_large: Callable[[], None] = lambda: None,
    ) -> None:
        """`after_large`: called once each large body is read (the socket's chunks it came
        in freed): service/ops/memory.py's trimmer, as the gRPC door's ReadGate has."""
        self.limits = limits
        self._after_large = after_large
        self.max_connections = descriptor_budget(
            "HTTP", limits.max_connections, HTTP_DESCRIPTOR_SHARE
        )
        self.max_per_address = address_share(
            limits.max_connections_per_address, self.max_connections
        )
        self._error = error
        self._open: dict[asyncio.Protocol, _Guarded] = {}  # by aiohttp's protocol
        self._by_address: dict[str, int] = {}  # connections open per client address
        self._over_address = RateLimitedLog(
            "HTTP connections from %s reached their address's share (%d): new ones from it "
            "are answered 503 and closed"
        )
        # Counted when the protocol is made: asyncio accepts a burst before any of its
        # connection_made calls run, and each accepted socket is a descriptor already.
        self._count = 0
        self._bodies = asyncio.Semaphore(limits.max_concurrent_bodies)
        self._large = asyncio.Semaphore(1)  # of them, the large bodies
        self._over_cap = RateLimitedLog(
            "HTTP connection cap reached (%d open): new connections are answered 503 and closed"
        )
        self.header_timeouts = 0
        self.body_timeouts = 0
        self.running = 0  # requests whose handlers have begun and not ended
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def open_connections(self) -> int:
        return self._count

    async def finished(self, timeout: float) -> bool:
        """Whether every running request ends within `timeout` seconds (the drain's grace)."""
        try:
            async with asyncio.timeout(timeout):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    def factory(self, inner: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        """The protocol factory for loop.create_server, around aiohttp's own (`inner`)."""

        def make() -> asyncio.Protocol:
            if self._count >= self.max_connections:
                self._over_cap.hit(self._count)
                return _OverCap()
            self._count += 1
            return _Guarded(self, inner())

        return make

    def opened(self, connection: _Guarded) -> bool:
        """Whether the connection is admitted: within its address's share."""
        held = self._by_address.get(connection.address, 0)
        if held >= self.max_per_address:
            self._over_address.hit(connection.address, held)
            return False
        self._by_address[connection.address] = held + 1
        self._open[connection.inner] = connection
        return True

    def closed(self, connection: _Guarded) -> None:
        self._count -= 1
        if connection.refused:
            return
        self._open.pop(connection.inner, None)
        left = self._by_address.get(connection.address, 0) - 1
        if left > 0:
            self._by_address[connection.address] = left
        else:
            self._by_address.pop(connection.address, None)

    # ------------------------------------------------------------------ middlewares

    @web.middleware
    async def track(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Outermost: the request's headers are complete, so its header timer stops; the
        drain counts it as running until its handler returns."""
        connection = self._open.get(request.protocol)  # type: ignore[call-overload]
        if connection is not None:
            connection.request_began()
        self.running += 1
        self._idle.clear()
        try:
            return await handler(request)
        finally:
            self.running -= 1
            if not self.running:
                self._idle.set()
            if connection is not None:
                connection.request_ended()

    @web.middleware
    async def read_body(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """After auth: read the body at a minimum rate, a bounded number at once.

        The route's read_raw (service/http/door.py) then takes the bytes read here.
        """
        if request.body_exists and request.match_info.http_exception is None:
            if declares_too_much(request):
                return await self._refuse(
                    request,
                    PoolingError(
                        ErrorKind.RESOURCE_EXHAUSTED,
                        "REQUEST_ENTITY_TOO_LARGE",
                        f"the body declares {request.content_length} bytes; the limit is "
                        f"{request.client_max_size}",
                    ),
                )
            if not request.content.is_eof():  # a body already whole needs no turn
                refusal = await self._read_paced(request)
                if refusal is not None:
                    return refusal
        try:
            return await handler(request)
        finally:
            body_parsed(request)  # where the route did not say so itself

    async def _read_paced(self, request: web.Request) -> web.StreamResponse | None:
        """Wait for a turn (a large body first for the large turn), then read the body.

        Three clients sending 16 MB bodies side by side grew the server by +79-95 MB read
        three at once; while a large body waits, all but aiohttp's small buffer of it stays
        in the client's socket. A large body keeps its turns until its route has parsed it
        (`body_parsed`): a 16 MB body refused for its count takes 50-200 ms to parse, and
        handing the turn on at once had the next bodies read meanwhile, three or four held
        at the peak."""
        limits = self.limits
        large = is_large(request)
        turns = (self._large, self._bodies) if large else (self._bodies,)
        taken: list[asyncio.Semaphore] = []
        try:
            async with asyncio.timeout(limits.body_timeout_s):
                for turn in turns:
                    await turn.acquire()
                    taken.append(turn)
        except TimeoutError:
            for turn in taken:
                turn.release()
            waiting = (
                f"a body of {LARGE_MESSAGE_BYTES} bytes or more (or of a length not known "
                "before it is read) is being read"
                if large and not taken  # still waiting for the large turn, taken first
                else f"{limits.max_concurrent_bodies} request bodies are being read"
            )
            return await self._refuse(
                request,
                PoolingError(
                    ErrorKind.UNAVAILABLE,
                    "TOO_MANY_BODIES",
                    f"{waiting}; none finished within {limits.body_timeout_s:g}s",
                    retry_after_s=1.0,
                ),
            )
        try:
            if await self._read_at_rate(request):
                if large:
                    request[HELD_TURNS], taken = taken, []
                return None
        finally:
            for turn in taken:
                turn.release()
            if large:
                self._after_large()
        self.body_timeouts += 1
        return await self._refuse(
            request,
            PoolingError(
                ErrorKind.DEADLINE_EXCEEDED,
                "BODY_TIMEOUT",
                f"the body arrived slower than {limits.body_min_bytes_per_s} bytes/s over "
                f"{limits.body_timeout_s:g}s",
            ),
        )

    async def _read_at_rate(self, request: web.Request) -> bool:
        """False when a window of body_timeout_s brought too few bytes.

        A body past the limit is 413 here. A read that fails otherwise (a body its
        Content-Encoding does not decode, the client gone) counts as done: the stream keeps
        the error, so the route's own read raises it again and answers it in its door's
        shape."""
        window = self.limits.body_timeout_s
        needed = self.limits.body_min_bytes_per_s * window
        content = request.content
        reading = asyncio.ensure_future(_read_whole(request))
        seen = 0
        try:
            while True:
                done, _ = await asyncio.wait({reading}, timeout=window)
                if done:
                    error = reading.exception()
                    if isinstance(error, web.HTTPException):  # 413: a body read past the limit
                        raise error
                    if error is None:
                        request[BODY] = reading.result()
                    return True
                received = content.total_raw_bytes
                if received - seen < needed:
                    return False
                seen = received
        finally:
            if reading.done():
                if not reading.cancelled():
                    reading.exception()  # retrieved: asyncio would log it as never seen
            else:
                reading.cancel()

    async def _refuse(self, request: web.Request, error: PoolingError) -> web.StreamResponse:
        """Answer, then close: the rest of the body is not worth reading."""
        response = self._error(request, error)
        response.force_close()
        await response.prepare(request)
        await response.write_eof()
        if request.transport is not None:
            _close(request.transport)
        return response


async def _read_whole(request: web.Request) -> bytearray:
    """The body in one buffer that grows in place. aiohttp's request.read() holds a large
    body about three times over at its peak (its stream buffer raised to twice the body
    limit, those chunks joined, a bytearray, then a bytes copy of it); this holds it once,
    plus the stream's usual buffer of 128 KiB."""
    limit = request.client_max_size
    content = request.content
    body = bytearray()
    while chunk := await content.readany():
        body += chunk
        if len(body) > limit:
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=len(body))
    return body


def body_read(request: web.Request) -> bytearray | None:
    """The body the guard read for the request, if it read one."""
    return request.get(BODY)


def body_parsed(request: web.Request) -> None:
    """The route holds what it needs of the body: a large body's turns pass on."""
    for turn in request.pop(HELD_TURNS, ()):
        turn.release()


def is_large(request: web.Request) -> bool:
    """A body that takes the large turn: LARGE_MESSAGE_BYTES or more declared, or one whose
    size is not known before it is read (chunked, or compressed: it may inflate)."""
    length = request.content_length
    return length is None or length >= LARGE_MESSAGE_BYTES or "Content-Encoding" in request.headers


def declares_too_much(request: web.Request) -> bool:
    """A Content-Length over the body limit: refused (413) without reading the body."""
    length = request.content_length
    return length is not None and length > request.client_max_size


def client_problem(exc: BaseException) -> str:
    """aiohttp's "400, message:\n  Can not decode ..." as "Can not decode ..."."""
    text = str(exc)
    return " ".join(text.partition("message:")[2].split() or text.split()) or type(exc).__name__


# ----------------------------------------------------------------- whole process


def _limit(value: int) -> str:
    return "unlimited" if value == resource.RLIM_INFINITY else str(value)


class ClientFaults(logging.Filter):
    """Keeps aiohttp's tracebacks for requests the client broke out of the log.

    aiohttp answers a request it cannot parse (a bad request line or header, a body its
    Content-Encoding does not decode, a client gone mid-body) with 400 or a closed socket,
    and logs a traceback at ERROR for each: a client could fill the log with them. They are
    the client's faults, answered already, so one rate-limited warning line says how many
    came; errors of any other kind pass through untouched."""

    FAULTS: tuple[type[BaseException], ...] = (
        HttpProcessingError,
        RequestPayloadError,
        ConnectionError,
    )

    def __init__(self) -> None:
        super().__init__()
        self._log = RateLimitedLog("refused malformed HTTP requests, the last: %s")

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, self.FAULTS):
            self._log.hit(f"{type(error).__name__}: {client_problem(error)[:200]}")
            return False
        return True

    @classmethod
    def install(cls) -> None:
        """Once per process, on aiohttp's server logger."""
        logger = logging.getLogger("aiohttp.server")
        if not any(isinstance(f, cls) for f in logger.filters):
            logger.addFilter(cls())


class AcceptErrors:
    """An event loop exception handler that rate-limits asyncio's accept failures.

    When descriptors run out, asyncio logs "socket.accept() out of system resource" for
    every failed accept, up to the backlog per loop turn (thousands of lines a second).
    The connection is refused either way; one line per period says so. On uvloop, libuv
    accepts and closes such connections itself and nothing is logged (measured: 200
    connects at a 64-descriptor limit, no line), so this matters on --event-loop asyncio.
    """

    MESSAGE = "socket.accept() out of system resource"

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._previous = loop.get_exception_handler()
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        self._log = RateLimitedLog(
            f"out of file descriptors (limit {_limit(soft)}): new HTTP connections are refused (%s)"
        )
        loop.set_exception_handler(self)

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") == self.MESSAGE:
            self._log.hit(context.get("exception"))
        elif self._previous is not None:
            self._previous(loop, context)
        else:
            loop.default_exception_handler(context)
