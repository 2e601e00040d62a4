"""How many processes a split server runs: front ends, and engines per device.

`--frontends auto` and `--engines-per-device auto` are resolved here, once, from the host
(CPU cores, visible NVIDIA GPUs) and the size of the models' weights, without importing
torch: the supervisor starts its children before anything heavy loads.

Why these numbers (issue 35's H200 runs, 16 cores, ~20-token texts):
- On a GPU one engine process is the ceiling: one GIL spends ~1 core launching kernels
  and reading links, while the card idles. A second engine on the same card (its own GIL,
  CUDA stream and copy of the weights) gave 1.41x the calls/s of one. Each engine wants a
  core or so of its own beside the front ends, so small models get one engine per 6 cores
  of the device's share, up to 4. A model whose weights pass LARGE_MODEL_BYTES is bound by
  arithmetic, not launches, and a second copy of it costs real memory: one engine.
- Front ends cost ~530 us of CPU per call: four on 16 cores passed one at C=1024, and
  eight gave nothing more. So one front end per 4 cores, at most 4 per device and 8 in all.
- On CPU the engines and front ends share two to a few cores, and one of each measured
  best (the README's CPU rows): auto stays at 1 and 1 there.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

AUTO = "auto"
LARGE_MODEL_BYTES = 2 * 1024**3  # about a 1B-parameter model in bfloat16
CORES_PER_ENGINE = 6
MAX_ENGINES_PER_DEVICE = 4
CORES_PER_FRONTEND = 4
MAX_FRONTENDS_PER_DEVICE = 4
MAX_FRONTENDS = 8
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".onnx")
NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")
DEVICE_NODES = Path("/dev")  # nvidia0, nvidia1, ...: what a container is given


@dataclass(frozen=True)
class Layout:
    frontends: int
    engines_per_device: int


def cuda_devices(device: str, environ: dict[str, str] | None = None) -> int:
    """The NVIDIA GPUs this server would use, read from the driver's folder (else the
    device nodes) and CUDA_VISIBLE_DEVICES, as torch would see them; 0 for `--device cpu`."""
    if device == "cpu":
        return 0
    environ = dict(os.environ) if environ is None else environ
    if NVIDIA_GPUS.is_dir():
        present = len(list(NVIDIA_GPUS.iterdir()))
    else:
        present = sum(1 for node in DEVICE_NODES.glob("nvidia*") if node.name[6:].isdigit())
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return present
    named = [part for part in visible.split(",") if part.strip()]
    if any(part.strip().startswith("-") for part in named):  # "-1": none from there on
        named = named[: next(i for i, p in enumerate(named) if p.strip().startswith("-"))]
    return min(present, len(named))


def weight_bytes(sources: Sequence[str]) -> int:
    """The largest local model folder's weight files, in bytes (0 for a hub name: not
    known before download, and then taken as small)."""
    largest = 0
    for source in sources:
        folder = Path(source)
        if folder.is_dir():
            files = (p for p in folder.rglob("*") if p.name.endswith(WEIGHT_SUFFIXES))
            largest = max(largest, sum(p.stat().st_size for p in files))
    return largest


def resolve(
    frontends: str | int,
    engines_per_device: str | int,
    gpus: int,
    cores: int,
    weights: int,
    fixed_ports: bool = True,
) -> Layout:
    """The counts the flags ask for, `auto` filled in for this host (see the docstring).
    `fixed_ports`: front ends can share the ports (a port of 0 cannot be shared)."""
    if frontends == AUTO:
        if gpus and fixed_ports:
            per_host = min(MAX_FRONTENDS_PER_DEVICE * gpus, MAX_FRONTENDS)
            frontends = max(1, min(cores // CORES_PER_FRONTEND, per_host))
        else:
            frontends = 1
    if engines_per_device == AUTO:
        if gpus and frontends and weights <= LARGE_MODEL_BYTES:
            share = cores // gpus
            engines_per_device = max(1, min(share // CORES_PER_ENGINE, MAX_ENGINES_PER_DEVICE))
        else:
            engines_per_device = 1
    return Layout(int(frontends), int(engines_per_device))
