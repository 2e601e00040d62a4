"""ONNX Runtime: export with torch.onnx (dynamic batch and length), int8 by dynamic
quantization, and sessions on ONNX Runtime's own CPU thread pools: one with every thread
for a lone pass, one with a worker's share for passes side by side. An image model's image
tower runs the same way, from engine/backends/image_tower.py's export."""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pooling_server.engine.backends import INPUT_NAMES, BackendKind, BackendOptions, ByShare
from pooling_server.engine.backends.export import Exported, ForwardOnly, ModelSource, output_name
from pooling_server.engine.models.model_info import HeadKind

log = logging.getLogger(__name__)

OPSET = 17
# Operators whose presence marks a graph as quantized.
INT8_OPS = frozenset(
    {"DynamicQuantizeLinear", "MatMulInteger", "QLinearMatMul", "QuantizeLinear", "QGemm"}
)


def version() -> str:
    import onnxruntime

    return onnxruntime.__version__


def export_graph(
    module: torch.nn.Module, head: HeadKind, example: dict[str, np.ndarray], path: Path
) -> None:
    """The traced forward (TorchScript exporter: no onnxscript needed), every input and the
    output dynamic in batch and length."""
    names = [name for name in INPUT_NAMES if name in example]
    output = output_name(head)
    axes = {name: {0: "batch", 1: "tokens"} for name in names}
    axes[output] = {0: "batch"} if head is HeadKind.SEQUENCE else {0: "batch", 1: "tokens"}
    tensors = tuple(torch.from_numpy(example[name]) for name in names)
    with torch.inference_mode(False), torch.no_grad():
        torch.onnx.export(
            ForwardOnly(module, head),
            tensors,
            str(path),
            input_names=names,
            output_names=[output],
            dynamic_axes=axes,
            opset_version=OPSET,
            dynamo=False,
        )


def quantize(source: Path, target: Path) -> None:
    """Dynamic int8: weights quantized per channel now, activations per batch at run time,
    so no calibration data is needed (sentence-transformers' and TEI's qint8 files)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(source, target, weight_type=QuantType.QInt8, per_channel=True)


def is_quantized(path: Path) -> bool:
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    return any(node.op_type in INT8_OPS for node in graph.node)


def session(path: Path, threads: int) -> Any:
    """A CPU session whose intra-op pool has `threads` threads."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


class OnnxBackend(Exported):
    """A session with an intra-op pool of every thread for a lone pass, and one with a pool
    of a worker's share for passes side by side (made at warm-up, where the second worker
    runs with its share), which the workers call at once: ONNX Runtime's run is thread-safe
    and releases the GIL.

    Two workers calling one session of two threads share its pool and wait on each other:
    MiniLM int8 at batch 32 here gave 655-780 texts/s against 1,039-1,088 on a session
    of one thread each, and 669-984 for a lone caller on the whole pool
    (benchmarks/results/cpu-2core-onnx-sessions.txt). The second session holds its own
    weights, as OpenVINO's second compilation does."""

    kind = BackendKind.ONNX
    package = "onnxruntime"
    suffix = ".onnx"
    files = ("model.onnx", "model_qint8.onnx")

    version = staticmethod(version)

    @classmethod
    def export(
        cls,
        source: ModelSource,
        example: dict[str, np.ndarray],
        options: BackendOptions,
        folder: Path,
        name: str,
    ) -> None:
        fp32 = folder / cls.files[0]
        export_graph(source.module, source.head, example, fp32)
        if name != fp32.name:  # int8: quantized from the float32 graph
            quantize(fp32, folder / name)

    @classmethod
    def open(cls, path: Path, head: HeadKind, threads: int, auto: bool = False) -> OnnxBackend:
        return cls(path, head, threads)

    @classmethod
    def open_image_tower(cls, path: Path, threads: int) -> OnnxImageTower:
        return OnnxImageTower(path, threads)

    def __init__(self, path: Path, head: HeadKind, threads: int) -> None:
        self.file = path
        self.by_share = ByShare(threads, partial(session, path))
        inputs = [i.name for i in self.by_share.whole.get_inputs()]
        unknown = [name for name in inputs if name not in INPUT_NAMES]
        if unknown or "input_ids" not in inputs:
            raise ValueError(
                f"{path}: the graph's inputs {inputs} are not input_ids, attention_mask and "
                "optionally token_type_ids"
            )
        self.input_names = tuple(inputs)
        outputs = [o.name for o in self.by_share.whole.get_outputs()]
        wanted = output_name(head)
        self.output = wanted if wanted in outputs else outputs[0]
        self.precision = "int8" if is_quantized(path) else "float32"

    def run(self, inputs: dict[str, np.ndarray], threads: int | None = None) -> np.ndarray:
        """`threads`: this pass's share of the cores (None: all of them)."""
        session = self.by_share.get(self.by_share.share(threads))
        (result,) = session.run([self.output], inputs)
        return np.asarray(result, dtype=np.float32)


class OnnxImageTower:
    """An image tower's export (pixel values in, the projected vectors out), a session per
    share of the cores as the text forward's."""

    kind = BackendKind.ONNX
    precision = "float32"
    fills_inputs = True
    input_names = ("pixel_values",)
    OUTPUT = "image_embeds"

    def __init__(self, path: Path, threads: int) -> None:
        self.file = path
        self.by_share = ByShare(threads, partial(_tower_session, path))

    def feed(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"pixel_values": np.ascontiguousarray(arrays["pixel_values"], dtype=np.float32)}

    def run(self, inputs: dict[str, np.ndarray], threads: int | None = None) -> np.ndarray:
        """float32 [n, 3, H, W] -> float32 [n, width]."""
        made = self.by_share.get(self.by_share.share(threads))
        (result,) = made.run([self.OUTPUT], inputs)
        return np.asarray(result, dtype=np.float32)

    def nearer(self) -> None:
        return None


def _tower_session(path: Path, threads: int) -> Any:
    """As the image tower's sessions have always been made: ONNX Runtime's default
    execution mode and graph optimizations."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
