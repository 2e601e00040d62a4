"""The backends by kind: each BackendKind's class, which implements the one interface
(engine/backends/__init__.py's Backend, and the class facts and `obtain`/`image_tower` that
export.py's Exported and torch_backend.py's TorchBackend give)."""

from __future__ import annotations

from typing import Any

from pooling_server.engine.backends import BackendKind, BackendUnavailable
from pooling_server.engine.backends.onnx_backend import OnnxBackend
from pooling_server.engine.backends.openvino_backend import OpenVinoBackend
from pooling_server.engine.backends.torch_backend import TorchBackend

REGISTRY: dict[BackendKind, Any] = {
    BackendKind.TORCH: TorchBackend,
    BackendKind.ONNX: OnnxBackend,
    BackendKind.OPENVINO: OpenVinoBackend,
}
# What --backend auto tries, in turn: the fastest first; torch serves every model.
AUTO_ORDER = (BackendKind.OPENVINO, BackendKind.ONNX, BackendKind.TORCH)
EVERY = tuple(REGISTRY)
FP32_MIN_COSINE = 0.9999  # every check input, against torch fp32


def backend_class(kind: BackendKind, model: str, hint: str = "") -> Any:
    """The class serving `kind`, once its package imports: a missing one is a clear load
    error (BackendUnavailable, `hint` after it)."""
    backend_type = REGISTRY[kind]
    try:
        backend_type.version()
    except ImportError as exc:
        raise BackendUnavailable(
            f"model {model}: --backend {kind} needs the {backend_type.package} package, which "
            f"does not import here ({exc}){hint}"
        ) from None
    return backend_type


def kind_of_file(file: str, model: str) -> BackendKind:
    """The backend whose file --backend-file names, by its ending."""
    for kind, backend_type in REGISTRY.items():
        if backend_type.suffix and file.endswith(backend_type.suffix):
            return kind
    raise ValueError(
        f"model {model}: --backend-file {file} is neither an ONNX file (.onnx) nor an "
        "OpenVINO model (.xml)"
    )
