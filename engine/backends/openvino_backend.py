"""OpenVINO: openvino.convert_model on the loaded module (dynamic shapes), int8 by nncf's
static post-training quantization, bfloat16 inference where the CPU has it, and a compiled
model with one infer request per forward worker, each running without the GIL on
OpenVINO's own threads.

A lone pass runs on a LATENCY-compiled model, one stream with every thread. Passes side by
side (the queue's second worker busy too) run on a second compilation with a stream per
share of the threads, so that they split the cores instead of waiting for the one stream.
On 2 cores, in alternating rounds: THROUGHPUT alone served 1.13x the calls at C=64 and cost
lone calls 16%; the two compilations together 1.06x at C=64 and no loss at C=1
(benchmarks/results/cpu-2core-alternate-openvino-*streams.json).

An image model's image tower compiles engine/backends/image_tower.py's ONNX export."""

from __future__ import annotations

import hashlib
import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pooling_server.engine.backends import (
    INPUT_NAMES,
    BackendKind,
    BackendOptions,
    BackendUnavailable,
    ByShare,
    read_calibration,
)
from pooling_server.engine.backends.export import Exported, ForwardOnly, ModelSource, output_name
from pooling_server.engine.models.model_info import HeadKind

log = logging.getLogger(__name__)

INT8_OPS = frozenset({"FakeQuantize", "FakeConvert"})


def version() -> str:
    import openvino

    return openvino.__version__


def bf16_native() -> bool:
    """Whether this CPU computes bfloat16 itself (AVX-512 BF16, AMX), as OpenVINO says."""
    import openvino as ov

    return "BF16" in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")


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


class OpenVinoBackend(Exported):
    """A compiled model on the CPU; each calling thread gets its own infer request."""

    kind = BackendKind.OPENVINO
    package = "openvino"
    suffix = ".xml"
    files = ("openvino_model.xml", "openvino_model_qint8.xml")

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
        model = convert(source.module, source.head, example)
        if options.quantize:
            try:
                import nncf  # noqa: F401
            except ImportError as exc:
                raise BackendUnavailable(
                    f"model {source.name}: --quantize int8 on openvino needs the nncf "
                    f"package, which does not import here ({exc}); install it, or use "
                    "--backend onnx"
                ) from None
            texts = read_calibration(options.calibration_file, source.name)
            model = quantize(model, [source.inputs([text]) for text in texts])
        save(model, folder / name)

    @classmethod
    def key_settings(cls, source: ModelSource, options: BackendOptions) -> dict[str, Any]:
        """int8: nncf's version and the calibration texts shape the export too."""
        if not options.quantize:
            return {}
        import nncf

        texts = read_calibration(options.calibration_file, source.name)
        return {
            "nncf": nncf.__version__,
            "calibration": hashlib.sha256("\n".join(texts).encode()).hexdigest(),
        }

    @classmethod
    def open(cls, path: Path, head: HeadKind, threads: int, auto: bool = False) -> OpenVinoBackend:
        """`auto`: a float32 export infers in bfloat16 where the CPU computes it itself (see
        select.py's choice: the parity check holds it to float32's bar)."""
        return cls(path, head, threads, bf16=auto and bf16_native())

    @classmethod
    def open_image_tower(cls, path: Path, threads: int) -> OpenVinoImageTower:
        return OpenVinoImageTower(path, threads)

    def __init__(self, path: Path, head: HeadKind, threads: int, bf16: bool = False) -> None:
        """`bf16`: infer in bfloat16 (OpenVINO's precision hint), weights as they are."""
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
        # A shipped export may take int32 ids, where the runner's arrays are int64.
        self._dtypes = [port.get_element_type().to_dtype() for port in model.inputs]
        quantized = is_quantized(model)
        self.precision = "int8" if quantized else "bfloat16" if bf16 else "float32"
        self._hint = "bf16" if bf16 else "f32"
        self._head = head
        wanted = output_name(head)
        outputs = [port.get_names() for port in model.outputs]
        self.output = next((i for i, n in enumerate(outputs) if wanted in n), 0)
        self._model = model
        self._core = core
        self.threads = threads
        self.by_share = ByShare(threads, self._compile)
        self.file = path
        self._local = threading.local()
        self._tensor = ov.Tensor

    def run(self, inputs: dict[str, np.ndarray], threads: int | None = None) -> np.ndarray:
        """`threads`: this pass's share of the cores (None: all of them)."""
        share = self.by_share.share(threads)
        compiled = self.by_share.get(share)
        requests: dict[int, Any] | None = getattr(self._local, "requests", None)
        if requests is None:
            requests = self._local.requests = {}  # this thread's, by share
        request = requests.get(share)
        if request is None:
            request = requests[share] = compiled.create_infer_request()
        # Tensors over the arrays themselves, set by port: OpenVINO's own dict dispatch
        # cost 55 us more per pass (a third of a tiny model's).
        for index, (name, dtype) in enumerate(zip(self.input_names, self._dtypes, strict=True)):
            array = np.ascontiguousarray(inputs[name], dtype)  # no copy when it matches
            request.set_input_tensor(index, self._tensor(array, shared_memory=True))
        request.infer()  # releases the GIL while it runs
        return np.array(request.get_output_tensor(self.output).data, dtype=np.float32)

    def _compile(self, threads: int) -> Any:
        """Every thread: one LATENCY stream. A share: a THROUGHPUT stream per share."""
        if threads == self.threads:
            config = self._config("LATENCY", 1, threads)
        else:
            streams = max(1, self.threads // threads)
            config = self._config("THROUGHPUT", streams, streams * threads)
        return self._core.compile_model(self._model, "CPU", config)

    def _config(self, hint: str, streams: int, threads: int) -> dict[str, Any]:
        return {
            "PERFORMANCE_HINT": hint,
            "NUM_STREAMS": streams,
            "INFERENCE_NUM_THREADS": threads,
            "INFERENCE_PRECISION_HINT": self._hint,
        }

    def nearer(self) -> OpenVinoBackend | None:
        """The same file compiled to infer in float32: where bfloat16 fails the check."""
        if self.precision != "bfloat16":
            return None
        return OpenVinoBackend(self.file, self._head, self.threads)


class OpenVinoImageTower:
    """An image tower's ONNX export compiled for the CPU in float32, a compilation per share
    of the cores; each calling thread gets its own infer request on each."""

    kind = BackendKind.OPENVINO
    precision = "float32"
    fills_inputs = True
    input_names = ("pixel_values",)

    def __init__(self, path: Path, threads: int) -> None:
        self.file = path
        self._local = threading.local()
        self.by_share = ByShare(threads, self._compile)

    def _compile(self, threads: int) -> Any:
        import openvino as ov

        config = {
            "PERFORMANCE_HINT": "LATENCY",
            "INFERENCE_NUM_THREADS": threads,
            "INFERENCE_PRECISION_HINT": "f32",
        }
        return ov.Core().compile_model(str(self.file), "CPU", config)

    def feed(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"pixel_values": np.ascontiguousarray(arrays["pixel_values"], dtype=np.float32)}

    def run(self, inputs: dict[str, np.ndarray], threads: int | None = None) -> np.ndarray:
        """float32 [n, 3, H, W] -> float32 [n, width]."""
        made = self.by_share.get(self.by_share.share(threads))
        requests: dict[int, Any] = getattr(self._local, "requests", None) or {}
        self._local.requests = requests
        request = requests.get(id(made))
        if request is None:
            request = requests[id(made)] = made.create_infer_request()
        request.infer({0: inputs["pixel_values"]})
        return np.array(request.get_output_tensor(0).data, dtype=np.float32)

    def nearer(self) -> None:
        return None
