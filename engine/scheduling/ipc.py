"""Messages between front-end processes and an engine process, and the link they travel on.

A message is a msgpack header (msgspec structs, encoded as arrays) followed by a raw
payload: token ids go one way and raw outputs come back as contiguous buffers that the
receiver views without copying, never as pickled per-item objects. Times are
time.monotonic() values, which every process on one host shares.

Each front end holds one Unix stream socket to each engine (`Link`), both ways: a message
is one sendmsg by the sender and is woken straight into the reader's blocked recv. ZMQ
served here before: its I/O threads made a message three thread wake-ups, and an idle
round trip cost 0.48 ms against 0.04 ms on a plain socket on this 2-core host.
"""

from __future__ import annotations

import contextlib
import math
import socket
import struct
import threading
from collections.abc import Callable, Sequence

import msgspec
import numpy as np

from pooling_server.engine.errors import ErrorKind, FieldViolation, PoolingError, internal_error
from pooling_server.engine.models.served import ModelDescription

IDS = np.dtype("<i4")
OUTPUTS = np.dtype("<f4")


class JobHeader(msgspec.Struct, array_like=True):
    id: int
    model: str
    deadline: float | None
    keep_tokens: bool
    lengths: list[int]  # tokens of each sequence, in order; ids (and types) are concatenated
    client: str = ""  # who asked, within the sending front end (Job.client)
    # Late chunking: per sequence, token ranges [a0, b0, a1, b1, ...] whose mean states
    # come back (engine/requests/late_chunking.py); empty when no sequence has any.
    pools: list[list[int]] = []
    # An image model's images (engine/inputs/modality.py's Frame), per sequence: [] for a
    # text, else [patches, channels, height, width]; an image's `lengths` entry is 0 ids,
    # its pixels float32 in the payload after the ids (and types). Empty: no images.
    frames: list[list[int]] = []
    # Send each batch's outputs as it ends (JobResult.indices), not all at the job's end.
    streams: bool = False
    adapter: str | None = None  # the LoRA adapter its sequences run with (Job.adapter)
    # The result cache's request tag (Job.cache); None: the cache is not used for it.
    cache: bytes | None = None


class Submit(msgspec.Struct, array_like=True, tag=0):
    """Payload: the concatenated token ids, then (if with_types) the token type ids, then
    every image's pixels (float32), in order."""

    origin: int
    with_types: bool
    jobs: list[JobHeader]


class Cancel(msgspec.Struct, array_like=True, tag=1):
    ids: list[int]


class Ping(msgspec.Struct, array_like=True, tag=2):
    """A front end asks whether the engine still reads its link (a stall check)."""

    sent: float


class Pong(msgspec.Struct, array_like=True, tag=3):
    """The engine's answer to a Ping, from the link's reader thread."""

    sent: float


class LoadModel(msgspec.Struct, array_like=True, tag=5):
    """A front end asks the engine to load a model at run time (service/repository.py):
    its name, source and per-model options as a Load call gave them; `startup`: one of the
    engine's own --model models, loaded again by its own spec."""

    id: int
    name: str
    source: str
    options: dict[str, str]
    startup: bool = False


# A LoadModel whose options name this loads a LoRA adapter (`source`, its folder) onto
# that served model; an UnloadModel naming an adapter drops it (service/adapters.py).
ADAPTER_BASE = "base-model"


class UnloadModel(msgspec.Struct, array_like=True, tag=6):
    """Stop a model's queue and free it: the front ends route nothing to it any more, and
    the calls they had sent it are answered."""

    id: int
    name: str


class ErrorInfo(msgspec.Struct, array_like=True):
    kind: str
    reason: str
    message: str
    retry_after_s: float | None = None
    violations: list[tuple[str, str, str]] = []
    metadata: dict[str, str] = {}

    @classmethod
    def of(cls, error: BaseException) -> ErrorInfo:
        if not isinstance(error, PoolingError):  # a bug, logged in the engine process
            error = internal_error()
        violations = [(v.field, v.description, v.reason) for v in error.violations]
        return cls(
            error.kind, error.reason, error.message, error.retry_after_s, violations, error.metadata
        )

    def error(self) -> PoolingError:
        violations = tuple(FieldViolation(*v) for v in self.violations)
        return PoolingError(
            ErrorKind(self.kind),
            self.reason,
            self.message,
            violations,
            dict(self.metadata),
            self.retry_after_s,
        )


class JobResult(msgspec.Struct, array_like=True):
    """One job's raw outputs (shapes in order; values in the data frame) or its error."""

    id: int
    shapes: list[list[int]]
    error: ErrorInfo | None
    enqueued: float
    started: float | None
    finished: float | None
    # A streaming job's outputs of one batch: the sequences the shapes belong to (the job
    # is answered once every sequence has come); None: the whole job's outputs, in order.
    indices: list[int] | None = None
    cached: int = 0  # Job.cached: tokens answered without a forward of their own


class Results(msgspec.Struct, array_like=True, tag=4):
    """Payload: every result's outputs as one float32 buffer, in order."""

    results: list[JobResult]


class ModelLoaded(msgspec.Struct, array_like=True, tag=5):
    """The engine's answer to LoadModel or UnloadModel (by id): for a load, the model's
    description (EngineReady's, as JSON) and what its weights take; or the error."""

    id: int
    description: bytes = b""
    memory_bytes: int = 0
    error: ErrorInfo | None = None


class ModelChanged(msgspec.Struct, array_like=True, tag=6):
    """An engine tells every other front end that a model another front end asked for is
    now loaded on it (`description`, as ModelLoaded's) or about to be unloaded (empty
    description): a front end routes a model once every engine has told it so, and
    answers an unload with `Withdrawn` once it routes nothing to it and its calls there are
    answered (service/repository.py's ModelManager.learned)."""

    id: int
    name: str
    source: str = ""
    description: bytes = b""
    memory_bytes: int = 0
    # A LoRA adapter's notice: the model it is on ("" for a model's). An adapter's load
    # carries its folder (`source`) and no description; its unload, neither.
    adapter_on: str = ""

    @property
    def unloading(self) -> bool:
        return not (self.source if self.adapter_on else self.description)


class Withdrawn(msgspec.Struct, array_like=True, tag=7):
    """A front end's answer to an unloading ModelChanged (by id)."""

    id: int


class EngineReady(msgspec.Struct):
    """Written by an engine process once its models are loaded and warm."""

    address: str
    pid: int
    models: list[ModelDescription]


ToEngine = Submit | Cancel | Ping | LoadModel | UnloadModel | Withdrawn
FromEngine = Results | Pong | ModelLoaded | ModelChanged
to_engine_decoder = msgspec.msgpack.Decoder(ToEngine)
from_engine_decoder = msgspec.msgpack.Decoder(FromEngine)
encoder = msgspec.msgpack.Encoder()


def unpack_outputs(
    buffer: np.ndarray, offset: int, shapes: Sequence[Sequence[int]]
) -> tuple[list[np.ndarray], int]:
    """Views into `buffer` (no copy) for one job's outputs; returns the offset after them."""
    arrays = []
    for shape in shapes:
        size = math.prod(shape)  # np.prod on a list cost 5 us an output
        arrays.append(buffer[offset : offset + size].reshape(shape))
        offset += size
    return arrays, offset


def start_daemon(target: Callable[..., None], name: str, *args: object) -> threading.Thread:
    """A link's reader (or acceptor, or watcher): a daemon thread, started."""
    thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    thread.start()
    return thread


_PREFIX = struct.Struct("<II")  # header bytes, payload bytes
# Without progress for this long a peer is taken for gone (a stopped process): the link
# closes rather than stall the engine's forward workers for every other front end.
SEND_TIMEOUT_S = 10.0


class Link:
    """One side of a front end's connection to an engine: framed messages both ways.

    Any thread may send (one message at a time, under a lock); one thread reads.
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        seconds, fraction = divmod(SEND_TIMEOUT_S, 1.0)
        timeval = struct.pack("ll", int(seconds), int(fraction * 1e6))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
        self._lock = threading.Lock()
        self._file = sock.makefile("rb", buffering=1 << 16)

    @classmethod
    def connect(cls, path: str) -> Link:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        return cls(sock)

    def send(self, header: bytes, payload: Sequence[bytes | np.ndarray] = ()) -> None:
        """One message; OSError if the peer is gone (the link is then closed)."""
        views = [memoryview(part).cast("B") for part in payload]
        parts = [memoryview(_PREFIX.pack(len(header), sum(map(len, views)))), memoryview(header)]
        parts += views
        with self._lock:
            try:
                while parts:
                    sent = self.sock.sendmsg(parts)
                    while parts and sent >= len(parts[0]):
                        sent -= len(parts[0])
                        parts.pop(0)
                    if sent:
                        parts[0] = parts[0][sent:]
            except OSError:
                self.close()  # a message cut short leaves the stream unreadable
                raise

    def read(self) -> tuple[bytes, bytearray] | None:
        """The next message's header and payload; None once the link is closed, by either
        side (the socket is then released)."""
        try:
            prefix = self._file.read(_PREFIX.size)
            if len(prefix) == _PREFIX.size:
                header_size, payload_size = _PREFIX.unpack(prefix)
                header = self._file.read(header_size)
                payload = bytearray(payload_size)
                if len(header) == header_size and self._file.readinto(payload) == payload_size:
                    return header, payload
        except (OSError, ValueError):  # ValueError: closed meanwhile
            pass
        self.close()
        self._file.close()
        self.sock.close()
        return None

    def close(self) -> None:
        """No more messages either way; wakes this link's reader."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
