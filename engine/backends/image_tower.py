"""An image model's image tower on ONNX Runtime or OpenVINO (CPU, float32).

The tower (get_image_features: pixel values in, the projected vectors out) is exported once
with torch.onnx, cached as the text exports are (keyed by the folder's files and the
versions), and checked against torch on a few frames before it serves. OpenVINO compiles the
same ONNX file. The text tower stays on torch: its inputs are a few tokens, where the image
tower's passes are the cost.
"""

from __future__ import annotations

import fcntl
import logging
import re
import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pooling_server.engine.backends import BackendKind, ByShare, RuntimeSettings, default_cache_dir
from pooling_server.engine.backends.onnx_backend import OPSET
from pooling_server.engine.backends.select import FP32_MIN_COSINE, hashed, model_key
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


class ImageTowerBackend:
    """The exported tower: ONNX Runtime sessions, or OpenVINO compiled models, one per
    share of the cores (see ThreadShare); both release the GIL while they run."""

    def __init__(self, kind: BackendKind, path: Path, threads: int) -> None:
        self.kind = kind
        self.file = path
        self.precision = "float32"
        self._local = threading.local()
        self.by_share = ByShare(threads, self._open)

    def _open(self, threads: int) -> Any:
        if self.kind is BackendKind.ONNX:
            import onnxruntime as ort

            options = ort.SessionOptions()
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
            options.log_severity_level = 3
            return ort.InferenceSession(str(self.file), options, providers=["CPUExecutionProvider"])
        import openvino as ov

        config = {
            "PERFORMANCE_HINT": "LATENCY",
            "INFERENCE_NUM_THREADS": threads,
            "INFERENCE_PRECISION_HINT": "f32",
        }
        return ov.Core().compile_model(str(self.file), "CPU", config)

    def run(self, pixels: np.ndarray, threads: int | None = None) -> np.ndarray:
        """float32 [n, 3, H, W] -> float32 [n, width]."""
        made = self.by_share.get(self.by_share.share(threads))
        pixels = np.ascontiguousarray(pixels, dtype=np.float32)
        if self.kind is BackendKind.ONNX:
            (result,) = made.run([OUTPUT], {INPUT: pixels})
            return np.asarray(result, dtype=np.float32)
        requests: dict[int, Any] = getattr(self._local, "requests", None) or {}
        self._local.requests = requests
        request = requests.get(id(made))
        if request is None:
            request = requests[id(made)] = made.create_infer_request()
        request.infer({0: pixels})
        return np.array(request.get_output_tensor(0).data, dtype=np.float32)


def load_image_tower(
    kind: BackendKind,
    name: str,
    folder: Path,
    module: torch.nn.Module,
    image_size: tuple[int, int],
    runtime: RuntimeSettings | None,
    threads: int,
) -> ImageTowerBackend:
    """The tower on `kind`, exported (or read from the cache) and checked against torch;
    ValueError naming the flag when it cannot serve."""
    package = "onnxruntime" if kind is BackendKind.ONNX else "openvino"
    try:
        __import__(package)
    except ImportError as exc:
        raise ValueError(
            f"model {name}: --backend {kind} needs the {package} package, which does not "
            f"import here ({exc}); or use --backend torch"
        ) from None
    path = _cached_export(name, folder, module, image_size, runtime)
    backend = ImageTowerBackend(kind, path, threads)
    rng = np.random.default_rng(0)
    frames = rng.standard_normal((CHECK_FRAMES, 3, *image_size)).astype(np.float32)
    with torch.inference_mode():
        reference = _ImageFeatures(module)(torch.from_numpy(frames)).float().numpy()
    output = backend.run(frames)
    cosines = np.sum(output * reference, axis=1) / (
        np.linalg.norm(output, axis=1) * np.linalg.norm(reference, axis=1)
    )
    low = float(cosines.min())
    log.info("model %s: image tower on %s, lowest cosine to torch %.6f", name, kind, low)
    if low < FP32_MIN_COSINE:
        raise ValueError(
            f"model {name}: the image tower on {kind} strays from torch (lowest cosine "
            f"{low:.6f}); use --backend torch"
        )
    return backend


def _cached_export(
    name: str,
    folder: Path,
    module: torch.nn.Module,
    image_size: tuple[int, int],
    runtime: RuntimeSettings | None,
) -> Path:
    """The tower's ONNX file, exported under the lock data-parallel engines share."""
    import onnxruntime

    settings = {
        "format": EXPORT_FORMAT,
        "tower": "image",
        "onnxruntime": onnxruntime.__version__,
        **model_key(folder, HeadKind.TOWERS, {"image_size": list(image_size)}),
    }
    root = (runtime.cache_dir if runtime else None) or default_cache_dir()
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", name)[-60:]
    entry = root / f"{slug}-image-tower-{hashed(settings)}"
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
                    _ImageFeatures(module),
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
