"""LoRA adapters on a served model: PEFT's adapters loaded beside the base weights, one of
them (or none) active for each forward pass (torch; imported only where models load).

PEFT injects each adapter's low-rank matrices into the base module's layers in place, so
every adapter shares the one copy of the base weights (on a GPU as on the CPU) and adds
only its own matrices. A batch holds one adapter's items (the queue forms batches per
adapter, engine/scheduling/batch_queue.py); before its pass the runner makes that adapter
the active one, or turns the adapter layers off for the base's items. The active adapter is
a property of the shared module, so a switch waits until no pass runs, while passes of the
adapter already active run side by side, as two workers' passes of a model without
adapters do (`using`); a pass wanting a switch holds back later passes of the active
adapter, so it waits for no more than the passes already running. A model without adapters
never comes here.

An adapter is computed as a side path (x W + x A B scaled), never merged into the weights:
merging per batch would rewrite every targeted matrix twice a batch and drift with each
round trip, where the side path costs two thin matmuls a layer and equals PEFT's
merge_and_unload() model to float rounding (tests/service/test_adapters.py).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from pooling_server.engine.errors import ErrorKind, PoolingError, clip


class AdapterSet:
    """The adapters loaded on one model's module, by name, and which one is active."""

    def __init__(self, module: torch.nn.Module, model: str) -> None:
        self.module = module  # the base module, PEFT's layers injected into it
        self.model = model
        self.paths: dict[str, str] = {}
        self._peft: object | None = None  # the PeftModel around `module`, once one loads
        self._active: str | None = None  # what the layers compute now (None: the base)
        # Passes running with `_active`, and passes waiting to switch it, under `_turn`.
        self._running = 0
        self._wanting = 0
        self._turn = threading.Condition()

    def load(self, name: str, path: str) -> int:
        """Read the adapter at `path` (a PEFT folder: adapter_config.json and its weights)
        onto the module, under the turn: no pass runs while layers are injected. Returns
        the bytes its own matrices take (the base weights are shared)."""
        from peft import PeftModel

        folder = Path(path).expanduser()
        if not (folder / "adapter_config.json").is_file():
            raise ValueError(f"{path}: not a PEFT adapter folder (no adapter_config.json)")
        with self._turn:
            self._quiesce()  # then held: no pass starts while layers change
            try:
                if self._peft is None:
                    peft = PeftModel.from_pretrained(self.module, str(folder), adapter_name=name)
                    self._peft = peft.eval()
                else:
                    self._peft.load_adapter(str(folder), adapter_name=name)  # type: ignore[attr-defined]
            except BaseException:
                # Layers injected before the weights failed (a shape that does not fit)
                # must not compute: every adapter layer off until a pass names one.
                _layers_off(self.module)
                self._active = None
                raise
            self._base_only()
            self.paths[name] = str(folder)
        marker = f".{name}."
        return sum(
            p.numel() * p.element_size()
            for key, p in self.module.named_parameters()
            if marker in key
        )

    def unload(self, name: str) -> None:
        """Its matrices dropped from every layer (the caller routes nothing to it any more)."""
        with self._turn:
            self._quiesce()
            if name not in self.paths or self._peft is None:
                return
            self._peft.delete_adapter(name)  # type: ignore[attr-defined]
            del self.paths[name]
            self._base_only()

    def _base_only(self) -> None:
        """The layers compute the base model (until a pass names an adapter)."""
        assert self._peft is not None
        self._peft.base_model.disable_adapter_layers()  # type: ignore[attr-defined]
        self._active = None

    def _quiesce(self) -> None:
        """Under the turn: wait until no pass runs, holding back new ones meanwhile."""
        self._wanting += 1
        try:
            self._turn.wait_for(lambda: self._running == 0)
        finally:
            self._wanting -= 1

    @contextmanager
    def using(self, adapter: str | None) -> Iterator[None]:
        """One pass with `adapter` active (None: the base weights alone). It joins the
        passes running if they use the same adapter and no pass waits to switch; else it
        waits until none runs, then switches the layers (only when the adapter differs
        from the last pass's: a run of batches of one adapter switches once)."""
        with self._turn:
            while True:
                if self._running == 0:  # nothing runs: this pass sets the adapter
                    self._switch(adapter)
                    break
                if adapter == self._active and not self._wanting:
                    break
                wants = adapter != self._active
                self._wanting += wants
                try:
                    self._turn.wait()  # every waiter is woken when the passes end
                finally:
                    self._wanting -= wants
            self._running += 1
        try:
            yield
        finally:
            with self._turn:
                self._running -= 1
                if self._running == 0:
                    self._turn.notify_all()

    def _switch(self, adapter: str | None) -> None:
        """Under the turn, no pass running: make `adapter` the one the layers compute."""
        if adapter == self._active:
            return
        peft = self._peft
        if adapter is not None and adapter not in self.paths:
            raise adapter_gone(adapter, self.model)
        if peft is not None:
            if adapter is None:
                peft.base_model.disable_adapter_layers()  # type: ignore[attr-defined]
            else:
                if self._active is None:
                    peft.base_model.enable_adapter_layers()  # type: ignore[attr-defined]
                peft.set_adapter(adapter)  # type: ignore[attr-defined]
        self._active = adapter


def _layers_off(module: torch.nn.Module) -> None:
    from peft.tuners.tuners_utils import BaseTunerLayer

    for layer in module.modules():
        if isinstance(layer, BaseTunerLayer):
            layer.enable_adapters(False)


def adapter_gone(adapter: str, model: str) -> PoolingError:
    """A batch for an adapter unloaded since its request was routed (a race the unload's
    drain closes in the front end; here only as a last guard)."""
    return PoolingError(
        ErrorKind.NOT_FOUND,
        "ADAPTER_NOT_FOUND",
        f'adapter "{clip(adapter)}" is not loaded on model "{clip(model)}"',
    )
