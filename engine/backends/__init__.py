"""Inference backends: torch, ONNX Runtime and OpenVINO, one interface, chosen per model.

Every backend implements `Backend` (select.py's REGISTRY maps each BackendKind to its
class): the transformer's forward (input ids, attention mask and token types in; the last
hidden state, or the logits of a classifier, a token classifier or a masked-LM head, out)
and an image model's image tower (pixel values in, the projected vectors out). Pooling,
Dense modules, activations and everything after them stay on the runner's code, fed by the
backend's output, so every task behaves the same whichever backend runs the forward.

torch runs the loaded module itself and is the reference the others are checked against;
ONNX Runtime and OpenVINO run an export of it (float32 or int8, on the CPU). Their packages
are optional: asking for a backend whose package is missing fails the load with a message
naming the flag.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import numpy as np


class BackendKind(StrEnum):
    AUTO = "auto"  # CPU: the fastest backend within cosine 0.9999 of torch; CUDA: torch
    TORCH = "torch"
    ONNX = "onnx"
    OPENVINO = "openvino"


class Quantize(StrEnum):
    INT8 = "int8"


# The names the forward's inputs take in every export, as transformers and
# sentence-transformers' ONNX and OpenVINO files name them.
INPUT_NAMES = ("input_ids", "attention_mask", "token_type_ids")


class Backend(Protocol):
    """A forward (the transformer's, or an image tower's); the queue's worker threads may
    call `run` at once. The runner pads a batch into numpy arrays, `feed` turns them into
    what `run` takes (torch: tensors on the device; an export: the arrays its graph names)."""

    kind: BackendKind
    precision: str  # "float32", "bfloat16", "float16" or "int8"
    file: Path | None  # the file it runs; None: the loaded module (torch)
    input_names: tuple[str, ...]  # the inputs it takes, in the graph's order
    # An export's graph takes every input it names (token types as zeros where the
    # tokenizer makes none); torch's module defaults the ones it is not given.
    fills_inputs: bool

    def feed(self, arrays: dict[str, np.ndarray]) -> dict[str, Any]: ...

    def run(self, inputs: dict[str, Any], threads: int | None = None) -> Any:
        """The output: (batch, tokens, width) states or logits, or (batch, labels) logits,
        or an image tower's (batch, width) vectors. An export's is float32 numpy, writable,
        owned by the caller; torch's a tensor on its device. `threads`: the pass's share of
        the cores, when other passes run beside it (see ThreadShare); None: all of them."""
        ...

    def nearer(self) -> Backend | None:
        """The same file run nearer torch's precision, where this one fails the parity
        check (OpenVINO's bfloat16 inference: its float32); None where there is none."""
        ...


T = TypeVar("T")


class ByShare(Generic[T]):
    """What runs a pass on a share of the cores (a compiled model, a session), made once per
    share: the one with every thread up front, a worker's share when passes first run side
    by side (at warm-up, where the second worker runs with its share; see ThreadShare)."""

    def __init__(self, threads: int, make: Callable[[int], T]) -> None:
        self.threads = threads
        self._make = make
        self.made: dict[int, T] = {threads: make(threads)}
        self._making = threading.Lock()

    @property
    def whole(self) -> T:
        return self.made[self.threads]

    def share(self, threads: int | None) -> int:
        """A pass's share of the cores: `threads`, or all of them (None)."""
        return min(threads or self.threads, self.threads)

    def get(self, share: int) -> T:
        made = self.made.get(share)
        if made is None:
            with self._making:
                made = self.made.get(share)
                if made is None:
                    made = self.made[share] = self._make(share)
        return made


class BackendUnavailable(ValueError):
    """A backend cannot serve this model here (package missing, device, export failure).

    With --backend auto the loader falls back to torch and logs the message; asked for
    explicitly, the load fails with it."""


@dataclass(frozen=True)
class BackendOptions:
    """What --backend and its companions ask for one model. The engine's own default is
    torch; the server's --backend defaults to auto."""

    kind: BackendKind = BackendKind.TORCH
    file: str | None = None  # --backend-file, relative to the model folder
    quantize: Quantize | None = None
    calibration_file: str | None = None  # None: the calibration set shipped here


@dataclass(frozen=True)
class RuntimeSettings:
    """Global settings every backend shares: where exports are cached."""

    cache_dir: Path | None = None  # None: default_cache_dir()


def default_cache_dir() -> Path:
    """$POOLING_CACHE_DIR, else $XDG_CACHE_HOME/pooling-server/backends, else ~/.cache/..."""
    import os

    explicit = os.environ.get("POOLING_BACKEND_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pooling-server" / "backends"


CALIBRATION_FILE = Path(__file__).with_name("calibration.txt")


def read_calibration(path: str | None, model: str) -> list[str]:
    """Calibration texts: UTF-8, one per line, blank lines skipped."""
    file = Path(path).expanduser() if path else CALIBRATION_FILE
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"model {model}: --calibration-file {file}: {exc}") from None
    texts = [line.strip() for line in lines if line.strip()]
    if not texts:
        raise ValueError(f"model {model}: --calibration-file {file} holds no text")
    return texts
