"""torch as a backend: the loaded module's own forward, and the reference every export is
checked against.

Nothing is exported: `obtain` hands back the module the loader loaded, in the dtype and on
the device it was loaded with (the only backend that runs off the CPU or below float32).
Its output stays a tensor on the device until the runner has pooled it.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pooling_server.engine.backends import INPUT_NAMES, BackendKind, BackendOptions, RuntimeSettings
from pooling_server.engine.models.model_info import HeadKind

if TYPE_CHECKING:
    from pooling_server.engine.backends.export import ModelSource, TowerSource
    from pooling_server.engine.models.cuda_graphs import GraphedForward


class TorchBackend:
    """The transformers module's forward over a padded batch, replayed from CUDA graphs
    where the batch's shape has one (engine/models/cuda_graphs.py)."""

    kind = BackendKind.TORCH
    package = "torch"
    exported = False  # runs the module itself: the reference, never checked against itself
    quantizes = False
    suffix = ""  # no file of its own for --backend-file
    file: Path | None = None
    fills_inputs = False

    def __init__(self, module: torch.nn.Module, head: HeadKind, device: torch.device) -> None:
        self.module = module
        self.head = head
        self.device = device
        self.precision = str(_dtype(module)).removeprefix("torch.")  # as loaded: see obtain
        # Decoders get no token_type_ids even when the tokenizer makes them.
        accepted = inspect.signature(module.forward).parameters
        self.input_names = tuple(name for name in INPUT_NAMES if name in accepted)
        self.graphs: GraphedForward | None = None  # None: always eager

    @staticmethod
    def version() -> str:
        return torch.__version__

    @staticmethod
    def runs_here(device: torch.device, dtype: torch.dtype) -> bool:
        return True

    @classmethod
    def obtain(
        cls,
        source: ModelSource,
        options: BackendOptions,
        settings: RuntimeSettings,
        threads: int,
        auto: bool,
    ) -> tuple[TorchBackend, str]:
        """The module as the loader loaded it, in the dtype it asked for (a module may keep
        some weights in float32); "torch" for the start-up log."""
        source.torch.precision = str(source.dtype).removeprefix("torch.")
        return source.torch, "torch"

    @classmethod
    def image_tower(cls, tower: TowerSource, settings: RuntimeSettings | None, threads: int) -> Any:
        return TorchImageTower(tower.module, tower.device)

    def feed(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """The arrays as tensors on the device; pinned memory speeds the copy to a GPU."""
        inputs = {k: torch.from_numpy(v) for k, v in arrays.items()}
        if self.device.type == "cuda":
            return {k: v.pin_memory().to(self.device, non_blocking=True) for k, v in inputs.items()}
        return inputs

    def run(self, inputs: dict[str, torch.Tensor], threads: int | None = None) -> torch.Tensor:
        """The caller sets torch's threads (ModelRunner.forward: they are per thread)."""
        graphed = self.graphs(inputs) if self.graphs is not None else None
        return self.output(self.module(**inputs)) if graphed is None else graphed

    def output(self, output: Any) -> torch.Tensor:
        """The one tensor of the module's output the runner reads."""
        if self.head is HeadKind.HIDDEN:
            return output.last_hidden_state  # type: ignore[no-any-return]
        return output.logits  # type: ignore[no-any-return]

    def reference(self, arrays: dict[str, np.ndarray]) -> np.ndarray:
        """The eager forward's output in float32 numpy: what an export is checked against."""
        with torch.inference_mode():
            tensors = {k: torch.from_numpy(v).to(self.device) for k, v in arrays.items()}
            return self.output(self.module(**tensors)).float().cpu().numpy()

    def nearer(self) -> None:
        return None


class TorchImageTower:
    """An image model's get_image_features on whatever inputs its processor makes (fixed-size
    pixels, or SigLIP 2's patches with their mask and grid)."""

    kind = BackendKind.TORCH
    file: Path | None = None
    fills_inputs = False
    input_names = ("pixel_values",)

    def __init__(self, module: torch.nn.Module, device: torch.device) -> None:
        self.module = module
        self.device = device
        self.dtype = _dtype(module)
        self.precision = str(self.dtype).removeprefix("torch.")

    def feed(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """Pixels in the module's dtype, masks and grids as they are."""
        return {
            name: torch.from_numpy(array).to(
                self.device, dtype=self.dtype if array.dtype.kind == "f" else None
            )
            for name, array in arrays.items()
        }

    def run(self, inputs: dict[str, torch.Tensor], threads: int | None = None) -> np.ndarray:
        return features(self.module.get_image_features(**inputs))

    def nearer(self) -> None:
        return None


def features(output: Any) -> np.ndarray:
    """A tower's vectors as float32 rows: transformers 5 returns them as the output's
    pooler_output, earlier releases as a bare tensor."""
    tensor = output if isinstance(output, torch.Tensor) else output.pooler_output
    return tensor.float().cpu().numpy()


def _dtype(module: torch.nn.Module) -> torch.dtype:
    parameter = next(module.parameters(), None)
    return parameter.dtype if parameter is not None else torch.float32
