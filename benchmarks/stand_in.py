"""A device stand-in: the real server with every forward pass replaced by a fixed wait.

Issue 12 asks what the server does in front of a fast accelerator (2 ms per batch of up to
256 items) on a machine that has none. This runs `pooling-server` with
`ModelRunner._forward` patched so that a batch still collates its inputs on the host, as the
real pass does, then holds the "device" for POOLING_STAND_IN_BATCH_MS milliseconds (default
2.0) whatever the batch's size, sleeping so the GIL is free, and returns float32 outputs of
the shapes the real pass returns (zeros). One device per process: passes of one process take
turns on it, as they would on one GPU, so a second forward worker overlaps only its host side.

The children of a split server (`--frontends N`) run through this module too, so the engine
processes that hold the models are the patched ones. Only the benchmark selects it; the model
is still loaded (its tokenizer and its config give the shapes), its weights are never used.

Run: POOLING_STAND_IN_BATCH_MS=2 python -m benchmarks.stand_in --max-batch-size 256 [server flags]
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from pooling_server.engine.inputs.tokenization import TokenSequence
    from pooling_server.engine.models.model_info import ModelInfo
    from pooling_server.engine.models.model_runner import ModelRunner

ENV = "POOLING_STAND_IN_BATCH_MS"
DEFAULT_BATCH_MS = 2.0


def batch_seconds() -> float:
    value = float(os.environ.get(ENV, DEFAULT_BATCH_MS))
    if value < 0:
        raise SystemExit(f"{ENV} must be >= 0, not {value}")
    return value / 1000


def outputs(
    info: ModelInfo, lengths: Sequence[int], keep_tokens: Sequence[bool]
) -> list[np.ndarray]:
    """Per sequence, what ModelRunner._forward returns for this head: zeros of its shape."""
    from pooling_server.engine.models.model_info import HeadKind

    if info.head is HeadKind.SEQUENCE:
        logits = np.zeros((len(lengths), len(info.labels)), dtype=np.float32)
        return [logits[i] for i in range(len(lengths))]
    longest = max(lengths, default=0)
    if info.head is HeadKind.TOKEN:
        logits = np.zeros((len(lengths), longest, len(info.labels)), dtype=np.float32)
        return [logits[i, :n] for i, n in enumerate(lengths)]
    pooled = np.zeros((len(lengths), info.hidden_size), dtype=np.float32)
    tokens = (
        np.zeros((len(lengths), longest, info.hidden_size), dtype=np.float32)
        if any(keep_tokens)
        else None
    )
    return [
        tokens[i, :n] if keep and tokens is not None else pooled[i]
        for i, (n, keep) in enumerate(zip(lengths, keep_tokens, strict=True))
    ]


def runs_models(argv: Sequence[str]) -> bool:
    """Whether this process loads the models: an engine, or a single-process server. A front
    end or a supervisor is left unpatched, so it imports no torch here either."""
    from pooling_server.service.cli import build_parser

    args = build_parser().parse_args(argv)
    return args.role == "engine" or (args.role is None and args.frontends == 0)


def install(seconds: float) -> None:
    """Patch ModelRunner._forward in this process (it imports torch)."""
    from pooling_server.engine.models.model_runner import ModelRunner

    device = threading.Lock()  # one device: passes take turns on it

    def _forward(
        self: ModelRunner,
        batch: Sequence[TokenSequence],
        keep_tokens: Sequence[bool],
        threads: int | None = None,
    ) -> list[np.ndarray]:
        self.collate(batch)  # the host side of a real pass
        with device:
            started = time.perf_counter()
            out = outputs(self.info, [len(e) for e in batch], keep_tokens)
            time.sleep(max(0.0, started + seconds - time.perf_counter()))
        return out

    ModelRunner._forward = _forward


def main(argv: Sequence[str] | None = None) -> int:
    from pooling_server.service.launch import main as serve
    from pooling_server.service.split import supervisor

    argv = list(sys.argv[1:] if argv is None else argv)
    seconds = batch_seconds()
    # Every child of a split server runs this module: the engines get the patch.
    supervisor.CHILD_COMMAND = [sys.executable, "-m", "benchmarks.stand_in"]
    if runs_models(argv):
        install(seconds)
    return serve(argv)


if __name__ == "__main__":
    raise SystemExit(main())
