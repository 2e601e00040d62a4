"""LoRA adapters on a served model: PEFT's adapters loaded beside the base weights, each
row of a forward pass computed through the adapter its item asked for (torch; imported only
where models load).

PEFT injects each adapter's low-rank matrices into the base module's layers in place, so
every adapter shares the one copy of the base weights (on a GPU as on the CPU) and adds
only its own matrices. A batch mixes adapters (the queue forms batches per model, not per
adapter): each LoRA layer takes the pass's row names and adds each adapter's side path to
its own rows only (PEFT's mixed-batch forward, `adapter_names`), the base's rows taking
none. Four adapters' traffic thus makes batches as full as one model's, where a batch per
adapter made four smaller ones and a switch of the active adapter waited for the passes
running (benchmarks/lora.py).

The names reach the layers through a pre-forward hook of this set's, read from the calling
thread: two forward workers' passes run side by side with their own names, where PEFT's own
`adapter_names` argument registers hooks on the shared module for one call at a time.
Loading or unloading an adapter changes the layers, so it waits until no pass runs, holding
back new ones meanwhile (`_turn`).

An adapter is computed as a side path (x W + x A B scaled), never merged into the weights:
merging would rewrite every targeted matrix per batch and drift with each round trip, where
the side path costs two thin matmuls a layer and equals PEFT's merge_and_unload() model to
float rounding (tests/engine/test_adapters.py, tests/service/test_adapters.py).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from pooling_server.engine.errors import ErrorKind, PoolingError, clip

BASE = "__base__"  # PEFT's row name for the base weights alone
_READS_ROWS = "_pooling_reads_rows"  # set on a LoRA layer once its hook is registered


class AdapterSet:
    """The adapters loaded on one model's module, by name."""

    def __init__(self, module: torch.nn.Module, model: str) -> None:
        self.module = module  # the base module, PEFT's layers injected into it
        self.model = model
        self.paths: dict[str, str] = {}
        self._peft: Any = None  # the PeftModel around `module`, once one loads
        self._rows = threading.local()  # `names`: the row names of this thread's pass
        # Passes running, and loads or unloads waiting for them to end, under `_turn`.
        self._running = 0
        self._changing = 0
        self._turn = threading.Condition()

    def load(self, name: str, path: str) -> int:
        """Read the adapter at `path` (a PEFT folder: adapter_config.json and its weights)
        onto the module, no pass running meanwhile. Returns the bytes its own matrices
        take (the base weights are shared). Loading a name already loaded from the same
        folder is answered as loaded (two front ends' loads at once); from another folder,
        refused."""
        from peft import PeftModel

        folder = Path(path).expanduser()
        if not (folder / "adapter_config.json").is_file():
            raise ValueError(f"{path}: not a PEFT adapter folder (no adapter_config.json)")
        if name == BASE:
            raise ValueError(f"{BASE!r} names the base weights; give the adapter another name")
        with self._layers_changing():
            if name in self.paths:  # two front ends asked at once: the first load serves both
                if self.paths[name] != str(folder):
                    loaded = self.paths[name]
                    raise ValueError(f"adapter {name!r} is already loaded from {loaded}")
                return self._bytes(name)
            try:
                if self._peft is None:
                    self._peft = PeftModel.from_pretrained(
                        self.module, str(folder), adapter_name=name
                    ).eval()
                else:
                    self._peft.load_adapter(str(folder), adapter_name=name)
            except BaseException:
                if self._peft is not None:  # its layers half-injected: gone, so the name
                    with contextlib.suppress(Exception):  # may be loaded again
                        self._peft.delete_adapter(name)
                raise
            finally:
                # Every LoRA layer reads the pass's rows, those of an adapter that failed
                # half-injected too: no row names it, so it computes nothing.
                self._hook_layers()
            self._peft.base_model.enable_adapter_layers()
            self.paths[name] = str(folder)
        return self._bytes(name)

    def _bytes(self, name: str) -> int:
        """What adapter `name`'s own matrices take."""
        marker = f".{name}."
        return sum(
            p.numel() * p.element_size()
            for key, p in self.module.named_parameters()
            if marker in key
        )

    def unload(self, name: str) -> None:
        """Its matrices dropped from every layer (the caller routes nothing to it any more)."""
        with self._layers_changing():
            if name not in self.paths or self._peft is None:
                return
            self._peft.delete_adapter(name)
            del self.paths[name]

    def _hook_layers(self) -> None:
        """Every LoRA layer not yet reading a pass's row names made to (the mark is on the
        layer itself, so it holds for the layer's life)."""
        from peft.tuners.tuners_utils import BaseTunerLayer

        for layer in self.module.modules():
            if isinstance(layer, BaseTunerLayer) and not getattr(layer, _READS_ROWS, False):
                layer.register_forward_pre_hook(self._with_rows, with_kwargs=True)
                setattr(layer, _READS_ROWS, True)

    def _with_rows(
        self, layer: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """A LoRA layer's call given its pass's row names (the base's for a pass outside
        `rows`, such as a warm-up). Runs per layer call: a lookup and a dict."""
        names = getattr(self._rows, "names", None)
        if names is None:
            names = [BASE] * len(args[0] if args else kwargs["x"])
        return args, {**kwargs, "adapter_names": names}

    @contextmanager
    def _layers_changing(self) -> Iterator[None]:
        """The turn held with no pass running: new passes are held back while the running
        ones end, and wait until the change is made."""
        with self._turn:
            self._changing += 1
            try:
                self._turn.wait_for(lambda: self._running == 0)
                yield
            finally:
                self._changing -= 1
                self._turn.notify_all()  # the passes held back

    @contextmanager
    def rows(self, adapters: Sequence[str | None]) -> Iterator[None]:
        """One pass whose row i runs through `adapters[i]` (None: the base weights alone).
        Passes run side by side; a load or unload waits for them."""
        names = [BASE if adapter is None else adapter for adapter in adapters]
        with self._turn:
            self._turn.wait_for(lambda: not self._changing)
            for adapter in set(adapters):
                if adapter is not None and adapter not in self.paths:
                    raise adapter_gone(adapter, self.model)
            self._running += 1
        self._rows.names = names
        try:
            yield
        finally:
            self._rows.names = None
            with self._turn:
                self._running -= 1
                if self._running == 0:
                    self._turn.notify_all()


def adapter_gone(adapter: str, model: str) -> PoolingError:
    """A batch for an adapter unloaded since its request was routed (a race the unload's
    drain closes in the front end; here only as a last guard)."""
    return PoolingError(
        ErrorKind.NOT_FOUND,
        "ADAPTER_NOT_FOUND",
        f'adapter "{clip(adapter)}" is not loaded on model "{clip(model)}"',
    )
