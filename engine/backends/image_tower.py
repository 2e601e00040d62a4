"""An image model's image tower on the backend asked for: torch runs the module's
get_image_features; ONNX Runtime and OpenVINO run its ONNX export (CPU, float32).

The tower (pixel values in, the projected vectors out) is exported once with torch.onnx,
cached as the text exports are (keyed by the folder's files and the versions), and checked
against torch on a few frames before it serves. OpenVINO compiles the same ONNX file. The
text tower stays on torch: its inputs are a few tokens, where the image tower's passes are
the cost.
"""

from __future__ import annotations

import fcntl
import logging
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pooling_server.engine.backends import (
    BackendKind,
    BackendUnavailable,
    RuntimeSettings,
    default_cache_dir,
)
from pooling_server.engine.backends.export import TowerSource, hashed, model_key, slug
from pooling_server.engine.backends.onnx_backend import OPSET
from pooling_server.engine.backends.registry import FP32_MIN_COSINE, backend_class
from pooling_server.engine.backends.torch_backend import features
from pooling_server.engine.models.model_info import HeadKind

log = logging.getLogger(__name__)

EXPORT_FORMAT = 1  # bump when the export changes, to leave old cache entries behind
INPUT = "pixel_values"
OUTPUT = "image_embeds"
CHECK_FRAMES = 3


class _ImageFeatures(torch.nn.Module):
    """get_image_features as a forward of one tensor in and one out, for the exporter."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        output = self.model.get_image_features(pixel_values=pixel_values)
        return output if isinstance(output, torch.Tensor) else output.pooler_output


def load_image_tower(
    kind: BackendKind, tower: TowerSource, runtime: RuntimeSettings | None, threads: int
) -> Any:
    """The tower on `kind` (a Backend over {"pixel_values": ...}, or whatever the torch
    module's processor makes), an export checked against torch; ValueError naming the flag
    when it cannot serve."""
    try:
        backend_type = backend_class(kind, tower.name, "; or use --backend torch")
    except BackendUnavailable as exc:
        raise ValueError(str(exc)) from None
    backend = backend_type.image_tower(tower, runtime, threads)
    if backend_type.exported:
        _check(tower, backend)
    return backend


def _check(tower: TowerSource, backend: Any) -> None:
    """The export's vectors against torch's on a few random frames."""
    rng = np.random.default_rng(0)
    frames = rng.standard_normal((CHECK_FRAMES, 3, *tower.image_size)).astype(np.float32)
    with torch.inference_mode():
        reference = features(_ImageFeatures(tower.module)(torch.from_numpy(frames)))
    output = backend.run(backend.feed({INPUT: frames}))
    cosines = np.sum(output * reference, axis=1) / (
        np.linalg.norm(output, axis=1) * np.linalg.norm(reference, axis=1)
    )
    low = float(cosines.min())
    log.info(
        "model %s: image tower on %s, lowest cosine to torch %.6f", tower.name, backend.kind, low
    )
    if low < FP32_MIN_COSINE:
        raise ValueError(
            f"model {tower.name}: the image tower on {backend.kind} strays from torch (lowest "
            f"cosine {low:.6f}); use --backend torch"
        )


def cached_export(tower: TowerSource, runtime: RuntimeSettings | None) -> Path:
    """The tower's ONNX file, exported under the lock data-parallel engines share."""
    import onnxruntime

    name, image_size = tower.name, tower.image_size
    settings = {
        "format": EXPORT_FORMAT,
        "tower": "image",
        "onnxruntime": onnxruntime.__version__,
        **model_key(tower.folder, HeadKind.TOWERS, {"image_size": list(image_size)}),
    }
    root = (runtime.cache_dir if runtime else None) or default_cache_dir()
    entry = root / f"{slug(name)}-image-tower-{hashed(settings)}"
    target = entry / "image_tower.onnx"
    root.mkdir(parents=True, exist_ok=True)
    with (root / f"{entry.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():
            return target
        staging = root / f".{entry.name}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        example = torch.zeros((2, 3, *image_size), dtype=torch.float32)
        try:
            with torch.inference_mode(False), torch.no_grad():
                torch.onnx.export(
                    _ImageFeatures(tower.module),
                    (example,),
                    str(staging / target.name),
                    input_names=[INPUT],
                    output_names=[OUTPUT],
                    dynamic_axes={INPUT: {0: "batch"}, OUTPUT: {0: "batch"}},
                    opset_version=OPSET,
                    dynamo=False,
                )
        except Exception as exc:
            shutil.rmtree(staging, ignore_errors=True)
            raise ValueError(
                f"model {name}: exporting the image tower to ONNX failed: {exc}; use "
                "--backend torch"
            ) from None
        shutil.rmtree(entry, ignore_errors=True)
        staging.rename(entry)
        log.info("model %s: image tower exported to %s", name, target)
    return target
