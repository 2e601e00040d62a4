"""A request's sequences on their way through a batching queue, and when they ran.

Shared by the queue (which computes them) and the engine clients (which hand them over),
so that neither needs the other, nor torch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from pooling_server.engine.inputs.tokenization import TokenSequence


@dataclass(slots=True)
class RequestTiming:
    """When a request's items entered the queue, and the span of the batches that ran them."""

    enqueued: float = 0.0
    started: float | None = None
    finished: float | None = None

    def add_batch(self, started: float, finished: float) -> None:
        if self.started is None or self.finished is None:  # the first (often only) batch
            self.started, self.finished = started, finished
            return
        self.started = min(self.started, started)
        self.finished = max(self.finished, finished)


@dataclass(eq=False, slots=True)
class Job:
    """One request's sequences (with whether every token's state is wanted) and its future.

    `finish` runs on the worker thread that computes the last sequence; its return value
    (or exception) resolves `future`. `raws` and `remaining` change under the queue's lock
    only; so does `failed`, but for an engine process's cancel, which sets it alone
    (engine/scheduling/core.py).
    """

    work: Sequence[tuple[TokenSequence, bool]]
    finish: Callable[[list[np.ndarray]], object]
    future: asyncio.Future[Any]
    deadline: float | None = None
    timing: RequestTiming = field(default_factory=RequestTiming)
    origin: int = 0  # which front end sent it, in an engine process; 0 in-process
    # Who asked, as the transport names it (a gRPC peer, an HTTP address; "": unnamed): the
    # queue bounds and takes turns per (origin, client), so one client cannot crowd out others.
    client: str = ""
    key: int = 0  # its id in an engine process, when one computes it
    # In an engine process: the front end's connection that sent it, which the answer or
    # the cancel takes the job from (engine/scheduling/core.py).
    reply_to: Any = None
    # Applied to each sequence's raw output where it arrives (the worker that computed it,
    # or a front end's results reader): `finish` gets what it returns. A plan whose outputs
    # reduce per sequence (MaxSim's scores) so keeps the reductions, never every matrix.
    fold: Callable[[int, np.ndarray], Any] | None = None
    # In an engine process: each batch's outputs go back as the batch ends (a `Partial`),
    # so the engine holds none of them and no answer is one message of every output.
    streams: bool = False
    # The LoRA adapter its sequences run with (None: the base weights): a batch mixes
    # adapters, each row through its own (engine/models/adapters.py).
    adapter: str | None = None
    raws: list[np.ndarray] = field(init=False)
    remaining: int = field(init=False)
    failed: bool = False
    # The result cache's request tag (engine/caching/key.py); None: no cache for it (off
    # in the server, or bypassed by the request).
    cache: bytes | None = None
    # Tokens of its sequences answered without a forward of their own (a cache hit, or
    # another request's forward in flight): usage's cached tokens.
    cached: int = 0

    def __post_init__(self) -> None:
        self.raws = [None] * len(self.work)  # type: ignore[list-item]
        self.remaining = len(self.work)

    @property
    def dead(self) -> bool:
        """Nobody waits for its items any more: the caller went away, or one item failed."""
        return self.failed or self.future.done()


@dataclass(slots=True)
class Partial:
    """A streaming job's outputs from one batch: which of its sequences, and their raws;
    `last` when they complete the job."""

    indices: list[int] = field(default_factory=list)
    raws: list[np.ndarray] = field(default_factory=list)
    last: bool = False


class HasFuture(Protocol):
    future: asyncio.Future[Any]


def settle(outcomes: Iterable[tuple[HasFuture, object]]) -> None:
    """On the event loop: each still-waited-for future gets its result, or its exception."""
    for holder, outcome in outcomes:
        future = holder.future
        if future.done():
            continue
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
