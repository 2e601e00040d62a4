"""The gRPC door on Node.js (--grpc-door node): the Python half.

grpcio's asyncio server spends about 0.3 ms of this process's GIL on every call (its
callbacks, reads and wake-ups), more than the request path itself, and the GIL is what a
loaded server runs out of. This door leaves gRPC to service/grpc/node_door.mjs in a child
process, on @grpc/grpc-js (the official gRPC for Node.js, pinned by package.json and
package-lock.json beside it): grpc-js holds the connections, unframes and inflates messages
and enforces the transport's limits and deadlines on its own core. Python receives each call
as frames over one Unix socket pair, many calls per read, and runs the very handlers a
grpc.aio server would (PoolingService as service/grpc/handlers.py registers it, health and
reflection) through a servicer context of its own (`_Call`). So the door changes how bytes
reach the handlers, never what they answer.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import inspect
import json
import logging
import os
import shutil
import socket
import struct
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from pooling_server.engine.errors import ErrorKind
from pooling_server.service.errors import grpc_code_of
from pooling_server.service.grpc.stream_limit import unsent_per_connection
from pooling_server.service.ops.auth import PROTECTED_PREFIX, BearerKeys
from pooling_server.service.ops.config import LARGE_MESSAGE_BYTES, ServerConfig

log = logging.getLogger(__name__)

SCRIPT = Path(__file__).with_name("node_door.mjs")
# Where `npm ci --omit=dev` (make node-door) installs grpc-js, beside the script.
GRPC_JS = SCRIPT.with_name("node_modules") / "@grpc" / "grpc-js" / "package.json"

# Link frames (node_door.mjs says what each carries): u32 length of what follows, u8 type,
# u32 call id, payload.
OPEN, MESSAGE, HALF_CLOSE, CANCEL, WRITTEN, FINISH, DRAIN, PULL, READY, DRAINED, KEYS = range(1, 12)
_HEADER = struct.Struct(">IBI")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_OPEN = struct.Struct(">IB")  # timeout ms, whole
NO_TIMEOUT = 0xFFFFFFFF
# The gRPC port's accept queue (the kernel caps it at net.core.somaxconn), given to Node
# too, which would listen again with 511: a burst of connections past the queue has its
# SYNs dropped and waits a second for them to be sent again.
LISTEN_BACKLOG = 4096
# Node's own accounting of one HTTP/2 session's memory, in MB: past it nghttp2 refuses new
# streams on that connection.
SESSION_MEMORY_MB = 64
# The share of --max-open-calls one connection, and one client address, may hold: streams
# opened and never sent on then lock out neither other connections nor other clients.
CONNECTION_SHARE = 32
CLIENT_SHARE = 2
MIN_CONNECTION_CALLS = 256  # a connection's share is never below this (or the cap itself)
# glibc raises its mmap threshold to the size of each large block freed, after which 16 MB
# message buffers come from the heap and stay in Node's RSS once freed (a flood of them grew
# it ~100 MB); a fixed threshold keeps each in its own mapping, returned when freed.
_NODE_ENV = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(256 * 1024)}

# The door's own answers, by reason (node_door.mjs's and this module's): each code is the
# errors table's, so neither half writes a status; Node is sent them at start.
REFUSALS: dict[str, ErrorKind] = {
    # Node's, before a handler sees the call or its message.
    "TIMEOUT_MALFORMED": ErrorKind.INVALID_ARGUMENT,
    "MESSAGE_CUT_SHORT": ErrorKind.INVALID_ARGUMENT,
    "COMPRESSION_CORRUPT": ErrorKind.INVALID_ARGUMENT,
    "COMPRESSED_WITHOUT_ENCODING": ErrorKind.INVALID_ARGUMENT,
    "ENCODING_UNSUPPORTED": ErrorKind.INVALID_ARGUMENT,
    "REQUEST_ENTITY_TOO_LARGE": ErrorKind.RESOURCE_EXHAUSTED,
    "TOO_MANY_CALLS": ErrorKind.RESOURCE_EXHAUSTED,
    "READ_TURN_TIMEOUT": ErrorKind.RESOURCE_EXHAUSTED,
    "ANSWERS_UNREAD": ErrorKind.RESOURCE_EXHAUSTED,
    "BODY_TIMEOUT": ErrorKind.DEADLINE_EXCEEDED,
    "SERVER_STOPPED": ErrorKind.UNAVAILABLE,
    # Both halves'.
    "UNAUTHENTICATED": ErrorKind.UNAUTHENTICATED,
    "CANCELLED": ErrorKind.CANCELLED,
    # This module's, as grpc.aio answers them.
    "NOT_FOUND": ErrorKind.NOT_FOUND,
    "MALFORMED_REQUEST": ErrorKind.INVALID_ARGUMENT,
    "ONE_MESSAGE_EXPECTED": ErrorKind.INVALID_ARGUMENT,
    "HANDLER_FAILED": ErrorKind.INTERNAL,
}
CODES: dict[str, grpc.StatusCode] = {
    reason: grpc_code_of(kind, reason) for reason, kind in REFUSALS.items()
}


class HandlerSet:
    """What `add_*_to_server` functions register, looked up by method path: stands in for
    the grpc.aio server those functions expect."""

    def __init__(self) -> None:
        self._generic: list[grpc.GenericRpcHandler] = []
        self._found: dict[str, grpc.RpcMethodHandler | None] = {}
        self.streams_out: dict[str, bool] = {}  # method path -> whether responses stream

    def add_generic_rpc_handlers(self, handlers: Iterable[grpc.GenericRpcHandler]) -> None:
        self._generic.extend(handlers)
        self._found.clear()

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        """The generic handlers registered beside these serve the same methods; here each
        method's path is noted, for Node to register it."""
        for name, handler in handlers.items():
            self.streams_out[f"/{service}/{name}"] = handler.response_streaming

    def lookup(self, path: str) -> grpc.RpcMethodHandler | None:
        if path not in self._found:
            details = _Details(path)
            found = None
            for generic in self._generic:
                found = generic.service(details)  # type: ignore[arg-type]
                if found is not None:
                    break
            if len(self._found) < 1024:  # unknown paths are the client's to choose
                self._found[path] = found
            return found
        return self._found[path]


class _Details:
    """The grpc.HandlerCallDetails a generic handler is asked with."""

    __slots__ = ("invocation_metadata", "method")

    def __init__(self, method: str) -> None:
        self.method = method
        self.invocation_metadata = ()


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, details: str, trailing: Sequence[Any]) -> None:
        super().__init__(details)
        self.code = code
        self.details = details
        self.trailing = tuple(trailing or ())


class _Call:
    """One call on the link, and the servicer context its handler gets (the part of
    grpc.aio.ServicerContext this project's handlers, health and reflection use)."""

    __slots__ = (
        "_code",
        "_details",
        "_link",
        "_peer",
        "deadline",
        "deserialize",
        "gone",
        "half_closed",
        "id",
        "messages",
        "metadata",
        "reading",
        "task",
        "trailing",
        "writing",
    )

    def __init__(
        self,
        link: _Link,
        call_id: int,
        deadline: float | None,
        peer: str,
        metadata: tuple[tuple[str, str | bytes], ...],
        messages: collections.deque[bytes],
        half_closed: bool,
    ) -> None:
        self._link = link
        self.id = call_id
        self.deadline = deadline
        self._peer = peer
        self.metadata = metadata
        self.messages = messages
        self.half_closed = half_closed
        self.deserialize: Callable[[bytes], Any] | None = None
        # What read and write wait for (a stream reads and writes side by side).
        self.reading: asyncio.Future[None] | None = None
        self.writing: asyncio.Future[None] | None = None
        self.trailing: tuple[Any, ...] = ()
        self.gone = False  # the client, its connection or its deadline ended the call
        self.task: asyncio.Task[None] | None = None
        self._code: grpc.StatusCode | None = None
        self._details = ""

    # The servicer context.
    def peer(self) -> str:
        return self._peer

    def invocation_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        return self.metadata

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def cancelled(self) -> bool:
        return self.gone

    def done(self) -> bool:
        return self.task is None or self.task.done()

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, str | bytes]]) -> None:
        self.trailing = tuple(metadata)

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        self._details = details

    async def abort(
        self,
        code: grpc.StatusCode,
        details: str = "",
        trailing_metadata: Sequence[tuple[str, str | bytes]] = (),
    ) -> None:
        raise _Abort(code, details, trailing_metadata)

    async def abort_with_status(self, status: grpc.Status) -> None:
        raise _Abort(status.code, status.details, status.trailing_metadata)

    async def read(self) -> Any:
        """The next request message, or grpc.aio.EOF once the client has sent its last."""
        while not self.messages:
            if self.half_closed:
                return grpc.aio.EOF
            self.reading = asyncio.get_running_loop().create_future()
            self._link.send(PULL, self.id)
            await self.reading
        assert self.deserialize is not None
        try:
            return self.deserialize(self.messages.popleft())
        except DecodeError as exc:  # health's or reflection's (Pool's parse is its own)
            details = f"the request does not parse: {exc}"
            raise _Abort(CODES["MALFORMED_REQUEST"], details, ()) from None

    async def write(self, message: Any) -> None:
        """Send a response message; returns once Node's HTTP/2 stream has taken it, so a
        client that does not read holds the handler back rather than this process's memory."""
        serialize = self._link.serializers[self.id]
        self.writing = asyncio.get_running_loop().create_future()
        self._link.send(MESSAGE, self.id, serialize(message))
        await self.writing

    async def requests(self) -> AsyncIterator[Any]:
        while (message := await self.read()) is not grpc.aio.EOF:
            yield message

    @staticmethod
    def wake(waiter: asyncio.Future[None] | None) -> None:
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class _Link(asyncio.Protocol):
    """The Python end of the link: frames in, handler tasks started, frames out."""

    def __init__(self, handlers: HandlerSet, keys: BearerKeys | None) -> None:
        self.handlers = handlers
        self.keys = keys
        self.calls: dict[int, _Call] = {}
        self.serializers: dict[int, Callable[[Any], bytes]] = {}
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.idle = asyncio.Event()  # no call open here
        self.idle.set()
        self.drained = asyncio.Event()  # none open in Node either, since DRAIN
        self._buffer = bytearray()
        self._transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()
        # Frames sent in one turn of the event loop, written together at its end: the calls
        # an engine's batch answers finish in one turn, and their FINISH frames then cost one
        # write here and one read in Node, not one each.
        self._out: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        for call in list(self.calls.values()):
            self._cancel(call)
        if not self.ready.done():
            self.ready.set_exception(RuntimeError("the Node.js gRPC door exited while starting"))
        self.drained.set()

    def send(self, kind: int, call_id: int, payload: bytes = b"") -> None:
        if self._transport is None or self._transport.is_closing():
            return
        out = self._out
        if not out:
            self._loop.call_soon(self.flush)
        out.append(_HEADER.pack(5 + len(payload), kind, call_id))
        if payload:
            out.append(payload)  # a large answer is not copied to join its header

    def flush(self) -> None:
        """Write the frames sent since the last flush, in one write (as they were sent)."""
        out, self._out = self._out, []
        if out and self._transport is not None and not self._transport.is_closing():
            self._transport.writelines(out)

    def close(self) -> None:
        if self._transport is not None:
            self.flush()
            self._transport.close()

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        view: bytes | memoryview
        if buffer:
            buffer += data
            view = memoryview(buffer)  # frames are copied out of it once, not sliced twice
        else:
            view = data  # the common case: whole frames in one read, no copy
        at, end = 0, len(view)
        unpack = _HEADER.unpack_from
        while end - at >= 9:
            length, kind, call_id = unpack(view, at)
            stop = at + 4 + length
            if stop > end:
                break
            if kind == OPEN:
                self._open(call_id, view, at + 9, stop)
            else:
                self._frame(kind, call_id, view, at + 9, stop)
            at = stop
        if isinstance(view, memoryview):
            view.release()
            del buffer[:at]
        elif at < end:
            buffer += data[at:]

    def _frame(self, kind: int, call_id: int, view: Any, start: int, stop: int) -> None:
        if kind == READY:
            if not self.ready.done():
                self.ready.set_result(None)
            return
        if kind == DRAINED:
            self.drained.set()
            return
        call = self.calls.get(call_id)
        if call is None:
            return
        if kind == MESSAGE:
            call.messages.append(bytes(view[start:stop]))
            call.wake(call.reading)
        elif kind == HALF_CLOSE:
            call.half_closed = True
            call.wake(call.reading)
        elif kind == WRITTEN:
            call.wake(call.writing)
        elif kind == CANCEL:
            call.gone = True
            self._cancel(call)

    def _open(self, call_id: int, view: Any, at: int, stop: int) -> None:
        timeout_ms, whole = _OPEN.unpack_from(view, at)
        at += 5
        (size,) = _U16.unpack_from(view, at)
        path = bytes(view[at + 2 : at + 2 + size]).decode("latin-1")
        at += 2 + size
        (size,) = _U16.unpack_from(view, at)
        peer = bytes(view[at + 2 : at + 2 + size]).decode("latin-1")
        at += 2 + size
        (count,) = _U16.unpack_from(view, at)
        at += 2
        metadata = []
        for _ in range(count):
            (size,) = _U16.unpack_from(view, at)
            key = bytes(view[at + 2 : at + 2 + size]).decode("latin-1")
            at += 2 + size
            (size,) = _U32.unpack_from(view, at)
            value = bytes(view[at + 4 : at + 4 + size])
            at += 4 + size
            metadata.append((key, value if key.endswith("-bin") else value.decode("latin-1")))
        (count,) = _U16.unpack_from(view, at)
        at += 2
        messages: collections.deque[bytes] = collections.deque()
        for _ in range(count):
            (size,) = _U32.unpack_from(view, at)
            messages.append(bytes(view[at + 4 : at + 4 + size]))
            at += 4 + size
        deadline = None if timeout_ms == NO_TIMEOUT else time.monotonic() + timeout_ms / 1000
        call = _Call(self, call_id, deadline, peer, tuple(metadata), messages, bool(whole))
        handler = self.handlers.lookup(path)
        if handler is None:
            self.finish(call_id, CODES["NOT_FOUND"], None, "Method not found!", ())
            return
        keys = self.keys
        if keys and path.startswith(PROTECTED_PREFIX) and not keys.allow_metadata(metadata):
            details = "missing or invalid credentials"
            self.finish(call_id, CODES["UNAUTHENTICATED"], None, details, ())
            return
        call.deserialize = handler.request_deserializer or _identity
        self.calls[call_id] = call
        self.idle.clear()
        call.task = asyncio.get_running_loop().create_task(self._serve(call, handler))
        call.task.add_done_callback(functools.partial(self._served, call))

    def _served(self, call: _Call, task: asyncio.Task[None]) -> None:
        """The call's bookkeeping, in a done callback rather than in `_serve`: a task
        cancelled before its first step never runs its body (a client's reset can come in
        the same read as its call), and the drain waits for `idle`."""
        self.calls.pop(call.id, None)
        self.serializers.pop(call.id, None)
        if not self.calls:
            self.idle.set()
        if task.cancelled() and not call.gone:  # stopped by the drain before it began
            self.finish(call.id, CODES["CANCELLED"], None, "Cancelled", ())

    def _cancel(self, call: _Call) -> None:
        if call.task is not None and not call.task.done():
            call.task.cancel()

    async def _serve(self, call: _Call, handler: grpc.RpcMethodHandler) -> None:
        code, message, details = grpc.StatusCode.OK, None, ""
        serialize = handler.response_serializer or _identity
        try:
            if handler.request_streaming:
                request: Any = call.requests()
            else:
                request = await _one(call)
            if handler.response_streaming:
                self.serializers[call.id] = serialize
                behaviour = handler.unary_stream or handler.stream_stream
                produced = behaviour(request, call)
                if inspect.isasyncgen(produced):
                    async for response in produced:
                        await call.write(response)
                else:
                    await produced
            else:
                behaviour = handler.unary_unary or handler.stream_unary
                response = await behaviour(request, call)
                if response is None:
                    raise RuntimeError("the handler returned no response")
                message = serialize(response)
            if call._code is not None:
                code, details = call._code, call._details
        except _Abort as abort:
            code, message, details, call.trailing = abort.code, None, abort.details, abort.trailing
        except asyncio.CancelledError:
            if call.gone:
                return  # Node has answered (deadline) or the stream is gone
            code, message, details = CODES["CANCELLED"], None, "Cancelled"
        except Exception as exc:
            log.exception("gRPC call %s failed", call.id)
            code, message = CODES["HANDLER_FAILED"], None
            details = f"Unexpected {type(exc)}: {exc}"
        if not call.gone:
            self.finish(call.id, code, message, details, call.trailing)

    def finish(
        self,
        call_id: int,
        code: grpc.StatusCode,
        message: bytes | None,
        details: str,
        trailing: Iterable[tuple[str, str | bytes]],
    ) -> None:
        parts = [bytes((code.value[0], message is not None))]
        if message is not None:
            parts += (_U32.pack(len(message)), message)
        encoded = details.encode()
        parts += (_U32.pack(len(encoded)), encoded)
        entries = [(key.encode("latin-1"), _value(value)) for key, value in trailing]
        parts.append(_U16.pack(len(entries)))
        for key, value in entries:
            parts += (_U16.pack(len(key)), key, _U32.pack(len(value)), value)
        self.send(FINISH, call_id, b"".join(parts))


def unary_request_paths(*services: Any) -> set[str]:
    """The method paths of `services` (protobuf service descriptors) that take one request
    message: Node sends such a call whole, once the client has ended its stream."""
    return {
        f"/{service.full_name}/{method.name}"
        for service in services
        for method in service.methods
        if not method.client_streaming
    }


def _kind(one_request: bool, streams_out: bool) -> str:
    """A method's kind as grpc-js names it. PoolingService's handlers all read a request
    stream (they enforce the one-message rule themselves), so whether a method takes one
    request comes from its descriptor (`whole_paths`), not from its handler."""
    if one_request:
        return "serverStream" if streams_out else "unary"
    return "bidi" if streams_out else "clientStream"


def installed() -> bool:
    """Whether grpc-js is installed beside node_door.mjs (`make node-door`, or `npm ci
    --omit=dev` in this package's folder)."""
    return GRPC_JS.is_file()


def _identity(data: Any) -> Any:
    return data


def _value(value: str | bytes) -> bytes:
    return value if isinstance(value, bytes) else value.encode("latin-1", "replace")


async def _one(call: _Call) -> Any:
    """The one request message of a method that takes one (health's)."""
    request = await call.read()
    if request is grpc.aio.EOF:
        raise _Abort(CODES["ONE_MESSAGE_EXPECTED"], "the call ended without its request", ())
    if await call.read() is not grpc.aio.EOF:
        raise _Abort(CODES["ONE_MESSAGE_EXPECTED"], "the call carried more than one request", ())
    return request


class NodeDoor:
    """Starts node_door.mjs on a listening socket bound here, and serves its calls."""

    def __init__(
        self,
        config: ServerConfig,
        handlers: HandlerSet,
        whole_paths: Iterable[str],
        on_exit: Callable[[int], None] = lambda code: None,
    ) -> None:
        self.config = config
        self.handlers = handlers
        self.whole_paths = sorted(whole_paths)
        self.on_exit = on_exit  # told the exit code when Node exits on its own
        self.keys = BearerKeys(config.api_keys) if config.api_keys else None
        self._link: _Link | None = None
        self._process: asyncio.subprocess.Process | None = None
        self._stopping = False
        self._watch: asyncio.Task[None] | None = None

    def _settings(self, listen_fd: int, link_fd: int) -> dict[str, Any]:
        transport = self.config.transport
        tls = self.config.tls
        max_message = self.config.max_message_bytes
        return {
            "listen_fd": listen_fd,
            "backlog": LISTEN_BACKLOG,
            "link_fd": link_fd,
            "unary_paths": self.whole_paths,
            "methods": {
                path: _kind(path in self.whole_paths, streams_out)
                for path, streams_out in self.handlers.streams_out.items()
            },
            "max_message_bytes": max_message,
            "large_message_bytes": LARGE_MESSAGE_BYTES,
            # Request bytes inflated or held at once, over every call: a message waiting its
            # turn (max_concurrent_reads messages' worth) stays in the client's socket.
            "read_budget_bytes": transport.max_concurrent_reads * max_message,
            "max_unsent_bytes": unsent_per_connection(transport, max_message),
            "max_unsent_total_bytes": transport.max_unsent_answer_bytes,
            "max_session_memory_mb": max(SESSION_MEMORY_MB, 4 * max_message >> 20),
            "max_concurrent_streams": transport.max_concurrent_streams,
            "open_calls": open_call_caps(transport.max_open_calls),
            "max_connections": transport.connection_cap(),
            "max_connections_per_address": transport.address_cap(),
            "max_connection_age_s": transport.max_connection_age_s,
            "max_connection_age_grace_s": transport.max_connection_age_grace_s,
            "max_connection_idle_s": transport.max_connection_idle_s,
            "keepalive_time_s": transport.keepalive_time_s,
            "keepalive_timeout_s": transport.keepalive_timeout_s,
            "keepalive_permit_without_calls": transport.keepalive_permit_without_calls,
            "min_client_ping_interval_s": transport.min_client_ping_interval_s,
            "handshake_timeout_s": transport.handshake_timeout_s,
            "gzip_responses": transport.gzip_responses,
            "tls": None if tls is None else dataclasses.asdict(tls),
            "refusals": {reason: code.value[0] for reason, code in CODES.items()},
        }

    async def start(self) -> int:
        """Listen, start Node on the socket, and return the port once Node serves it."""
        node = shutil.which("node")
        if node is None:
            raise RuntimeError(
                "--grpc-door node needs Node.js (20 or newer) as `node` on PATH; install it "
                "or serve gRPC with --grpc-door grpcio"
            )
        if not installed():
            raise RuntimeError(
                f"--grpc-door node needs @grpc/grpc-js, installed by `npm ci --omit=dev` in "
                f"{SCRIPT.parent} (`make node-door` in a clone); or serve gRPC with "
                "--grpc-door grpcio"
            )
        listener = _listen(self.config.host, self.config.port, self.config.transport.reuse_port)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            settings = json.dumps(self._settings(listener.fileno(), theirs.fileno()))
            self._process = await asyncio.create_subprocess_exec(
                node,
                "--expose-gc",  # node_door.mjs collects after large messages
                str(SCRIPT),
                settings,
                pass_fds=(listener.fileno(), theirs.fileno()),
                env=_NODE_ENV,
            )
        finally:
            port = listener.getsockname()[1]
            listener.close()
            theirs.close()
        loop = asyncio.get_running_loop()
        _, link = await loop.connect_accepted_socket(lambda: _Link(self.handlers, self.keys), ours)
        self._link = link
        if self.config.api_keys:  # over the link, never in Node's command line
            keys = [key.encode() for key in self.config.api_keys if key]
            link.send(KEYS, 0, _U16.pack(len(keys)) + b"".join(_U32.pack(len(k)) + k for k in keys))
        self._watch = asyncio.create_task(self._watch_process())
        await link.ready
        return port

    async def _watch_process(self) -> None:
        assert self._process is not None
        code = await self._process.wait()
        if not self._stopping:
            log.error("the Node.js gRPC door exited (code %s)", code)
            self.on_exit(code)

    async def stop(self, grace: float) -> bool:
        """Drain: GOAWAY on every connection, then wait up to `grace` for the calls open,
        here and in Node (whose calls may still be arriving); True when calls were still
        running and were cancelled."""
        self._stopping = True
        link = self._link
        ran_out = False
        if link is not None:
            link.send(DRAIN, 0)

            async def quiet() -> None:
                await link.drained.wait()
                await link.idle.wait()

            try:
                await asyncio.wait_for(quiet(), grace)
            except TimeoutError:
                ran_out = grace > 0
            for call in list(link.calls.values()):
                link._cancel(call)
            await asyncio.sleep(0)  # the cancelled calls send their status
            link.close()
        if self._process is not None:
            try:
                await asyncio.wait_for(self._process.wait(), 5.0)
            except TimeoutError:
                self._process.kill()
                await self._process.wait()
        if self._watch is not None:
            await asyncio.gather(self._watch, return_exceptions=True)
        return ran_out


def open_call_caps(total: int) -> dict[str, int]:
    """--max-open-calls in all, and the shares of it one connection and one client address
    may hold (0: no limit)."""
    if not total:
        return {"total": 0, "per_connection": 0, "per_client": 0}
    per_connection = max(total // CONNECTION_SHARE, min(total, MIN_CONNECTION_CALLS))
    return {
        "total": total,
        "per_connection": per_connection,
        "per_client": max(per_connection, total // CLIENT_SHARE),
    }


def _listen(host: str, port: int, reuse_port: bool) -> socket.socket:
    """The gRPC port's listening socket, handed to Node (so front ends can share it)."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        listener.bind(address)
        listener.listen(LISTEN_BACKLOG)
    except OSError as exc:
        listener.close()
        raise RuntimeError(f"cannot listen on {host}:{port}: is the port taken? ({exc})") from exc
    return listener
