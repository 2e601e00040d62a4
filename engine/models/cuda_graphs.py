"""CUDA graphs for the torch forward pass: which padded shapes get a graph, their capture
at load, and their replay (issue 35, launch overhead).

This module owns the bucket policy (`Buckets`: batch sizes x padded lengths, pure Python),
the choice of the shapes worth capturing (`select_shapes`: smallest first, within a memory
budget for the static outputs), and `GraphedForward`, which holds one captured graph per
shape with its static inputs and output, copies a padded batch in, replays, and hands back
the output sliced to the real [batch, longest]. ModelRunner calls it for the torch module's
forward and runs eagerly whenever it answers None (a shape outside the buckets); the loader
attaches it on a CUDA device with the torch backend unless --cuda-graphs off.

An encoder's eager forward on a GPU is bound by kernel launches: on an H200 a 12-layer,
768-wide BERT on a 32 x 24-token batch took 7.3 ms eager against 1.5 ms replayed as a
graph (the issue's figures). Nothing GPU-side of this module has been measured in this
tree: capture time, capture memory, replay speed and parity on CUDA are unmeasured; the
copy-in, padding and slice-out logic is tested on the CPU through an injectable capture
(`eager_capture`) that runs the real module on the static tensors.

`torch.compile(mode="reduce-overhead")` (which captures CUDA graphs of its own) is the
alternative; it was not measured either, and direct capture was chosen because it adds no
compile time at start-up and no recompiles on new shapes.

Padding: rows past the real batch get pad ids and a mask with only column 0 set, so no
row is fully masked (SDPA can answer NaN for one); columns past the longest sequence are
masked out as the eager batch's own padding is, so real rows' outputs equal eager on the
same sequences within float tolerance, and pooling uses the real mask.

Threads: the graphs share one memory pool, so two of them must never replay at once; one
lock per GraphedForward covers the copy-in, the replay launch and the clone of the output
(launches only: on one device the passes queue on the same stream anyway).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
LENGTH_BUCKETS = (16, 32, 64, 128, 256, 512)

# Attention that pads by masking, so a batch's shape alone decides the kernels.
CAPTURABLE_ATTENTION = frozenset({"eager", "sdpa"})

# Eager passes on a side stream before each capture (cuBLAS handles, lazy buffers).
WARM_UP_RUNS = 2

Shape = tuple[int, int]  # (batch size, padded length)


@dataclass(frozen=True)
class GraphSettings:
    """What --cuda-graphs on captures: the batcher's caps and the bounds on the graphs."""

    max_batch_size: int = 256
    max_batch_tokens: int | None = None  # the batcher's padded-token cap; None: none
    max_length: int = 512  # longer padded lengths run eagerly
    max_output_bytes: int = 1 << 30  # static outputs of all graphs together


def _capped(buckets: Sequence[int], cap: int) -> tuple[int, ...]:
    """The buckets below `cap`, then `cap` itself: every size up to the cap has one."""
    if cap < 1:
        return ()
    return (*(b for b in buckets if b < cap), cap)


@dataclass(frozen=True)
class Buckets:
    """Batch-size and length buckets; `shapes` are the (B, L) pairs that have a graph."""

    batch_sizes: tuple[int, ...]
    lengths: tuple[int, ...]
    shapes: frozenset[Shape] = field(default_factory=frozenset)

    @classmethod
    def for_model(
        cls,
        max_batch_size: int,
        max_input_tokens: int,
        max_length: int = 512,
        max_batch_tokens: int | None = None,
    ) -> Buckets:
        """Powers of two capped at the largest batch and at the model's longest input
        (or max_length, if shorter); without the shapes no batch can reach under
        max_batch_tokens (padded tokens, as the batcher counts them: a lone sequence may
        be longer)."""
        sizes = _capped(BATCH_BUCKETS, max_batch_size)
        lengths = _capped(LENGTH_BUCKETS, min(max_input_tokens, max_length))
        shapes = set()
        for i, size in enumerate(sizes):
            smallest_rows = sizes[i - 1] + 1 if i else 1
            for j, length in enumerate(lengths):
                shortest = lengths[j - 1] + 1 if j else 1
                reachable = (
                    max_batch_tokens is None
                    or smallest_rows == 1
                    or smallest_rows * shortest <= max_batch_tokens
                )
                if reachable:
                    shapes.add((size, length))
        return cls(sizes, lengths, frozenset(shapes))

    def bucket(self, batch: int, longest: int) -> Shape | None:
        """The smallest (B, L) of the grid that holds the batch, captured or not."""
        size = next((b for b in self.batch_sizes if b >= batch), None)
        length = next((n for n in self.lengths if n >= longest), None)
        if size is None or length is None:
            return None
        return size, length

    def choose(self, batch: int, longest: int) -> Shape | None:
        """The smallest bucket that holds a batch of `batch` rows padded to `longest`;
        None (run eagerly) when it is outside the buckets or that shape has no graph."""
        shape = self.bucket(batch, longest)
        return shape if shape in self.shapes else None

    def only(self, shapes: Sequence[Shape]) -> Buckets:
        return replace(self, shapes=frozenset(shapes) & self.shapes)


def select_shapes(
    shapes: Sequence[Shape], bytes_per_shape: Callable[[Shape], int], budget: int
) -> list[Shape]:
    """The shapes whose static outputs fit in `budget` together, taken smallest first: small
    batches are the launch-bound ones, the largest gain least from a graph."""
    chosen, used = [], 0
    for shape in sorted(shapes, key=lambda s: (s[0] * s[1], s)):
        cost = bytes_per_shape(shape)
        if used + cost <= budget:
            chosen.append(shape)
            used += cost
    return chosen


# A capture takes the forward as a closure over the static inputs and returns what replays
# it (refilling the static output in place) and that static output.
Replay = Callable[[], None]
Capture = Callable[[Callable[[], torch.Tensor]], tuple[Replay, torch.Tensor]]


def eager_capture(run: Callable[[], torch.Tensor]) -> tuple[Replay, torch.Tensor]:
    """A stand-in for a CUDA graph on any device: the replay runs the module again on the
    static inputs and writes the static output in place, as a graph's replay does."""
    output = run().clone()

    def replay() -> None:
        output.copy_(run())

    return replay, output


class CudaCapture:
    """Captures on CUDA: each shape is warmed on a side stream, then captured into a graph
    that shares one memory pool with the others (capture the largest first)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: list[torch.cuda.CUDAGraph] = []  # kept alive with their replays

    def __call__(self, run: Callable[[], torch.Tensor]) -> tuple[Replay, torch.Tensor]:
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(WARM_UP_RUNS):
                run()
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = run()
        self.graphs.append(graph)
        return graph.replay, output


@dataclass
class _Graph:
    inputs: dict[str, torch.Tensor]  # static: the batch is copied in before each replay
    output: torch.Tensor  # static: refilled by each replay
    replay: Replay


@dataclass(frozen=True)
class CaptureStats:
    """What capture cost at start-up, for the log and for benchmarks to record."""

    graphs: int
    seconds: float
    memory_bytes: int  # CUDA memory the graphs keep reserved (0 off CUDA)
    static_bytes: int  # the static outputs alone
    left_eager: int  # shapes of the grid left to eager by the output budget
    shapes: tuple[Shape, ...] = ()


class GraphedForward:
    """The module's forward replayed from graphs captured for bucketed shapes.

    `output` picks the tensor of the module's output (ModelRunner._output); `token_types`:
    the module takes token_type_ids (zeros where the batch has none, as it defaults them).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        output: Callable[[Any], torch.Tensor],
        buckets: Buckets,
        device: torch.device,
        pad_token_id: int,
        token_types: bool,
        capture: Capture | None = None,
    ) -> None:
        self.module = module
        self.output = output
        self.buckets = buckets
        self.device = device
        self.pad_token_id = pad_token_id
        self.token_types = token_types
        self.capture = capture or CudaCapture(device)
        # The cache a decoder would build is never read, and would be captured with it.
        self.extra: dict[str, Any] = (
            {"use_cache": False}
            if "use_cache" in inspect.signature(module.forward).parameters
            else {}
        )
        self.graphs: dict[Shape, _Graph] = {}
        self.stats: CaptureStats | None = None
        self.replays = 0  # how many passes a graph served
        self._lock = threading.Lock()

    @torch.inference_mode()
    def capture_all(self, max_output_bytes: int = GraphSettings.max_output_bytes) -> CaptureStats:
        """Capture every shape whose static output fits the budget, largest first."""
        with _on(self.device):
            return self._capture_all(max_output_bytes)

    def _capture_all(self, max_output_bytes: int) -> CaptureStats:
        started = time.monotonic()
        on_cuda = self.device.type == "cuda"
        if on_cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            reserved = torch.cuda.memory_reserved(self.device)
        shapes = select_shapes(sorted(self.buckets.shapes), self._output_bytes(), max_output_bytes)
        left = len(self.buckets.shapes) - len(shapes)
        self.buckets = self.buckets.only(shapes)
        for shape in sorted(shapes, key=lambda s: (s[0] * s[1], s), reverse=True):
            inputs = self._static_inputs(shape)
            self._reset(inputs)
            replay, out = self.capture(lambda inputs=inputs: self._run(inputs))
            self.graphs[shape] = _Graph(inputs, out, replay)
        memory = 0
        if on_cuda:
            # What the graphs hold (their pool, static tensors), not the warm-ups' cache.
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            memory = max(0, torch.cuda.memory_reserved(self.device) - reserved)
        static = sum(g.output.numel() * g.output.element_size() for g in self.graphs.values())
        self.stats = CaptureStats(
            len(self.graphs),
            time.monotonic() - started,
            memory,
            static,
            left,
            tuple(sorted(self.graphs)),
        )
        return self.stats

    def __call__(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The module's output for a padded batch (the runner's collated tensors), sliced
        to its [batch, longest]; None when its shape has no graph (run it eagerly)."""
        ids = inputs["input_ids"]
        batch, longest = ids.shape
        shape = self.buckets.choose(batch, longest)
        graph = self.graphs.get(shape) if shape is not None else None
        if graph is None:
            return None
        with self._lock, _on(self.device):
            static = graph.inputs
            self._reset(static)
            static["input_ids"][:batch, :longest].copy_(ids)
            static["attention_mask"][:batch, :longest].copy_(inputs["attention_mask"])
            if "token_type_ids" in static and "token_type_ids" in inputs:
                static["token_type_ids"][:batch, :longest].copy_(inputs["token_type_ids"])
            graph.replay()
            self.replays += 1
            out = graph.output
            # Per-token outputs are sliced to the batch's own padded length, as eager's.
            return (out[:batch, :longest] if out.dim() > 2 else out[:batch]).clone()

    def _static_inputs(self, shape: Shape) -> dict[str, torch.Tensor]:
        names = ["input_ids", "attention_mask"] + (["token_type_ids"] if self.token_types else [])
        return {name: torch.zeros(shape, dtype=torch.int64, device=self.device) for name in names}

    def _reset(self, inputs: dict[str, torch.Tensor]) -> None:
        """Every row a lone pad token (no row fully masked), before the batch is copied in."""
        inputs["input_ids"].fill_(self.pad_token_id)
        mask = inputs["attention_mask"]
        mask.zero_()
        mask[:, 0] = 1
        if "token_type_ids" in inputs:
            inputs["token_type_ids"].zero_()

    def _run(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.output(self.module(**inputs, **self.extra))

    def _output_bytes(self) -> Callable[[Shape], int]:
        """The static output's size per shape, from an eager pass on the smallest one:
        [B, C] for a sequence classifier, [B, L, width] otherwise."""
        probe = (1, self.buckets.lengths[0]) if self.buckets.lengths else (1, 1)
        inputs = self._static_inputs(probe)
        self._reset(inputs)
        sample = self._run(inputs)
        size = sample.element_size()
        if sample.dim() > 2:
            width = sample[0, 0].numel()
            return lambda s: s[0] * s[1] * width * size
        width = sample[0].numel()
        return lambda s: s[0] * width * size


def why_eager(
    settings: GraphSettings | None,
    device: torch.device,
    torch_forward: bool,
    attention: str | None = "sdpa",
) -> str | None:
    """Why the forward gets no graphs, or None: graphs are for the torch module's forward
    on CUDA, with an attention that pads by masking (`attention`: the module config's
    _attn_implementation)."""
    if settings is None:
        return "--cuda-graphs off"
    if device.type != "cuda":
        return f"the device is {device.type}, not cuda"
    if not torch_forward:
        return "the forward runs on a compiled backend"
    if attention not in CAPTURABLE_ATTENTION:
        return (
            f"attention {attention} is not captured (only "
            f"{', '.join(sorted(CAPTURABLE_ATTENTION))}: flash attention unpads a batch into "
            "shapes that depend on its lengths)"
        )
    return None


def attention_of(module: torch.nn.Module) -> str | None:
    """The attention implementation transformers chose for the module."""
    return getattr(getattr(module, "config", None), "_attn_implementation", None)


def _on(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """`device` current, for the streams and graphs that take the current CUDA device (an
    engine process on cuda:1 does not make it current)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
