"""OpenVINO: openvino.convert_model on the loaded module (dynamic shapes), int8 by nncf's
static post-training quantization, and a compiled model with one infer request per
forward worker, each running without the GIL on OpenVINO's own threads."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.backends import INPUT_NAMES, BackendKind
from engine.backends.export import ForwardOnly, output_name
from engine.model_info import HeadKind

log = logging.getLogger(__name__)

INT8_OPS = frozenset({"FakeQuantize", "FakeConvert"})


def version() -> str:
    import openvino

    return openvino.__version__


def convert(module: torch.nn.Module, head: HeadKind, example: dict[str, np.ndarray]) -> Any:
    """The forward as an ov.Model, every input dynamic in batch and length."""
    import openvino as ov

    names = [name for name in INPUT_NAMES if name in example]
    example_input = {name: torch.from_numpy(example[name]) for name in names}
    with torch.inference_mode(False), torch.no_grad():
        model = ov.convert_model(ForwardOnly(module, head), example_input=example_input)
    model.reshape({model.input(i): ov.PartialShape([-1, -1]) for i in range(len(names))})
    for i, name in enumerate(names):
        model.input(i).get_tensor().set_names({name})
    model.output(0).get_tensor().set_names({output_name(head)})
    return model


def save(model: Any, path: Path) -> None:
    """Weights kept in float32 (save_model would halve them to float16 by default)."""
    import openvino as ov

    ov.save_model(model, str(path), compress_to_fp16=False)


def read(path: Path) -> Any:
    import openvino as ov

    return ov.Core().read_model(str(path))


def quantize(model: Any, calibration: list[dict[str, np.ndarray]]) -> Any:
    """Static int8 with activation ranges measured on the calibration inputs (one text each,
    so no padding skews them); the transformer preset keeps sensitive ops in float."""
    import nncf

    return nncf.quantize(
        model,
        nncf.Dataset(calibration),
        model_type=nncf.ModelType.TRANSFORMER,
        subset_size=len(calibration),
    )


def is_quantized(model: Any) -> bool:
    return any(op.get_type_name() in INT8_OPS for op in model.get_ordered_ops())


class OpenVinoBackend:
    """A compiled model on the CPU; each calling thread gets its own infer request."""

    kind = BackendKind.OPENVINO

    def __init__(self, path: Path, head: HeadKind, threads: int) -> None:
        import openvino as ov

        core = ov.Core()
        model = core.read_model(str(path))
        names = [next(iter(port.get_names()), "") for port in model.inputs]
        unknown = [name for name in names if name not in INPUT_NAMES]
        if unknown or "input_ids" not in names:
            raise ValueError(
                f"{path}: the model's inputs {names} are not input_ids, attention_mask and "
                "optionally token_type_ids"
            )
        self.input_names = tuple(names)
        self.precision = "int8" if is_quantized(model) else "float32"
        wanted = output_name(head)
        outputs = [port.get_names() for port in model.outputs]
        self.output = next((i for i, n in enumerate(outputs) if wanted in n), 0)
        config = {
            # One stream with every thread: a lone batch takes all the cores; a second
            # worker's request waits for the stream rather than splitting them.
            "PERFORMANCE_HINT": "LATENCY",
            "INFERENCE_NUM_THREADS": threads,
            "INFERENCE_PRECISION_HINT": "f32",
        }
        self.compiled = core.compile_model(model, "CPU", config)
        self.file = path
        self._local = threading.local()

    def run(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        request = getattr(self._local, "request", None)
        if request is None:
            request = self._local.request = self.compiled.create_infer_request()
        request.infer(inputs, share_inputs=True)  # releases the GIL while it runs
        return np.array(request.get_output_tensor(self.output).data, dtype=np.float32)
