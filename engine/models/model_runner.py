"""One forward pass over a padded batch, returning each sequence's raw output on the CPU.

The forward runs on a backend (engine/backends: torch, ONNX Runtime, OpenVINO), all behind
one interface; its output goes through the same pooling and projection code here (or its
family's own pooling of logits, SPLADE's),
so the backend is invisible to the queue and to everything after it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pooling_server.engine.backends import Backend
from pooling_server.engine.backends.torch_backend import TorchBackend
from pooling_server.engine.inputs.tokenization import TokenSequence
from pooling_server.engine.models.adapters import AdapterSet
from pooling_server.engine.models.cuda_graphs import GraphedForward
from pooling_server.engine.models.model_info import HeadKind, ModelInfo
from pooling_server.engine.models.pooling import pool, pool_array
from pooling_server.engine.models.served import ServedModel


@dataclass(frozen=True)
class ThreadShare:
    """Intra-op threads for a forward pass: all the cores alone, a share beside another.

    Torch keeps the thread count per calling thread, so each worker sets its own. Every
    thread that runs a pass with more than one thread keeps an OpenMP pool, and once the
    pools hold more threads than there are cores OpenMP stops spinning between parallel
    regions, which slows every pass: with `shared` at 1 only one pool exists.
    """

    alone: int
    shared: int


class ModelRunner:
    """Runs a transformers module; the queue's worker threads may call it at once.

    Per sequence it returns: HIDDEN head, the pooled vector (or every token's state
    when `keep_tokens`; or, where its keep value is a tuple of token ranges, late
    chunking's mean state of each range, projected, as one row each); SEQUENCE head, the
    logits; TOKEN head, the logits per token, or where its family pools them (`pool_logits`:
    SPLADE's masked-LM head) one vocabulary vector. An LLM reranker's
    scorer is a SEQUENCE head: logit(true) - logit(false) at the last real token (its
    family's scorer).
    """

    def __init__(
        self,
        module: torch.nn.Module | None,
        info: ModelInfo,
        pad_token_id: int,
        device: torch.device,
        warm_up_batch: Sequence[TokenSequence] = (),
        projection: torch.nn.Module | None = None,
        backend: Backend | None = None,
        pool_logits: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """`projection`: sentence-transformers' Dense modules, applied to pooled vectors.
        `backend`: what runs the forward; None: torch, on `module`. `pool_logits`: a
        family's pooling of per-token logits and the mask into one row per sequence
        (SPLADE's), for a head whose rows are pooled by its family."""
        self.projection = projection
        self.pool_logits = pool_logits
        self.warm_up_batch = list(warm_up_batch)
        self.info = info
        self.pad_token_id = pad_token_id
        self.device = device
        self.threads: ThreadShare | None = None  # None: leave torch's setting alone
        # LoRA adapters on the torch module (engine/models/adapters.py); None: none ever
        # loaded, and a pass takes no turn.
        self.adapters: AdapterSet | None = None
        self.use(backend or TorchBackend(module, info.head, device))  # type: ignore[arg-type]

    def use(self, backend: Backend) -> None:
        """Run the forward on `backend` from now on (the loader's choice, after the torch
        one it was checked against): the runner lets go of whatever ran it before."""
        self.backend = backend
        self.accepts_token_type_ids = "token_type_ids" in backend.input_names
        # An export's graph takes token types wherever it names them: zeros where the
        # tokenizer makes none, as the torch module defaults them.
        self.fills_token_types = backend.fills_inputs and self.accepts_token_type_ids

    @property
    def module(self) -> torch.nn.Module | None:
        """The torch module that runs the forward; None on an export."""
        return self.backend.module  # type: ignore[attr-defined,no-any-return]

    @module.setter
    def module(self, module: torch.nn.Module) -> None:
        self.backend.module = module  # type: ignore[attr-defined]

    @property
    def graphs(self) -> GraphedForward | None:
        """The torch forward replayed from CUDA graphs where a batch's shape has one
        (engine/models/cuda_graphs.py); None: always eager."""
        return self.backend.graphs  # type: ignore[attr-defined,no-any-return]

    @graphs.setter
    def graphs(self, graphs: GraphedForward | None) -> None:
        self.backend.graphs = graphs  # type: ignore[attr-defined]

    def arrays(self, batch: Sequence[TokenSequence]) -> dict[str, np.ndarray]:
        """Right-pad to the longest sequence, filled in numpy: a tensor per row costs more
        than the forward pass of a small model. A backend whose graph takes token types
        gets zeros where the tokenizer makes none, as the torch module defaults them.

        Every row at once: the ids of all sequences joined, then scattered through the
        mask, rather than a numpy assignment per row (~1.5 us a row, most of a batch's
        host time in front of a fast device)."""
        rows = [e.input_ids for e in batch]
        lengths = np.fromiter(map(len, rows), dtype=np.intp, count=len(batch))
        longest = int(lengths.max())
        filled = np.arange(longest) < lengths[:, None]
        ids = np.full((len(batch), longest), self.pad_token_id, dtype=np.int64)
        ids[filled] = _joined(rows, int(lengths.sum()))
        with_types = self.accepts_token_type_ids and all(
            e.token_type_ids is not None for e in batch
        )
        arrays = {"input_ids": ids, "attention_mask": filled.astype(np.int64)}
        if with_types or self.fills_token_types:
            types = np.zeros((len(batch), longest), dtype=np.int64)
            if with_types:
                types[filled] = _joined(
                    [e.token_type_ids for e in batch],  # type: ignore[misc]
                    int(lengths.sum()),
                )
            arrays["token_type_ids"] = types
        return arrays

    def collate(self, batch: Sequence[TokenSequence]) -> dict[str, Any]:
        """The padded batch as the backend takes it (torch: tensors on the device)."""
        return self.backend.feed(self.arrays(batch))

    def forward(
        self,
        batch: Sequence[TokenSequence],
        keep_tokens: Sequence[bool],
        alone: bool = True,
        adapters: Sequence[str | None] = (),
    ) -> list[np.ndarray]:
        """`alone`: no other forward pass runs beside this one (see ThreadShare).
        `adapters`: the LoRA adapter each item asked for (None: the base weights), on a
        model with adapters."""
        threads = None
        if self.threads is not None:
            threads = self.threads.alone if alone else self.threads.shared
            torch.set_num_threads(threads)
        if self.adapters is None:
            return self._forward(batch, keep_tokens, threads)
        with self.adapters.rows(adapters or [None] * len(batch)):
            return self._forward(batch, keep_tokens, threads)

    def _output(self, output: object) -> torch.Tensor:
        """The tensor of the torch module's output the runner reads (GraphedForward's)."""
        return self.backend.output(output)  # type: ignore[attr-defined,no-any-return]

    @torch.inference_mode()
    def _forward(
        self, batch: Sequence[TokenSequence], keep_tokens: Sequence[bool], threads: int | None
    ) -> list[np.ndarray]:
        """A backend's output stays in numpy through pooling (see pool_array); the torch
        module's stays a tensor on its device until the pooled vectors come back."""
        arrays = self.arrays(batch)
        inputs = self.backend.feed(arrays)
        output: np.ndarray | torch.Tensor = self.backend.run(inputs, threads)
        # The mask where the output is: the host's arrays, or torch's tensor on its device.
        on_host = isinstance(output, np.ndarray)
        mask = arrays["attention_mask"] if on_host else inputs["attention_mask"]
        lengths = [len(e) for e in batch]
        head = self.info.head
        if self.pool_logits is not None:  # its family pools the per-token logits (SPLADE)
            pooled_logits = self.pool_logits(torch.as_tensor(output), torch.as_tensor(mask))
            vocab = pooled_logits.cpu().numpy()
            return [vocab[i] for i in range(len(batch))]
        if head is HeadKind.SEQUENCE:  # one row per sequence
            logits = _host(output)
            return [logits[i] for i in range(len(batch))]
        if head is HeadKind.TOKEN:
            logits = _host(output)
            return [logits[i, :n] for i, n in enumerate(lengths)]
        wanted = [not isinstance(k, tuple) and bool(k) for k in keep_tokens]  # tuple: late chunks
        rows = any(wanted)
        chunks: dict[int, np.ndarray] = {}
        if isinstance(output, np.ndarray):
            hidden = _host(output)
            pooled = pool_array(hidden, mask, self.info.pooling_type)  # type: ignore[arg-type]
            if self.projection is not None:
                pooled = self.projection(torch.from_numpy(pooled)).numpy()
            tokens = hidden if rows else None
            for i, keep in enumerate(keep_tokens):
                if isinstance(keep, tuple):
                    means = torch.from_numpy(_span_means(hidden[i], keep))
                    chunks[i] = (self.projection(means) if self.projection else means).numpy()
        else:
            states = output.float()
            pooled_states = pool(states, mask, self.info.pooling_type)  # type: ignore[arg-type]
            if self.projection is not None:
                pooled_states = self.projection(pooled_states)
            pooled = pooled_states.cpu().numpy()
            tokens = states.cpu().numpy() if rows else None
            for i, keep in enumerate(keep_tokens):
                if isinstance(keep, tuple):
                    means = _span_means(states[i], keep)
                    chunks[i] = (self.projection(means) if self.projection else means).cpu().numpy()
        outputs = [
            tokens[i, :n] if keep and tokens is not None else pooled[i]
            for i, (n, keep) in enumerate(zip(lengths, wanted, strict=True))
        ]
        for i, means in chunks.items():
            outputs[i] = means
        return outputs

    def warm_up(self, alone: bool = True) -> None:
        """Run once on the thread that will serve: torch's thread pools, and CUDA's handles,
        belong to the calling thread, so warming anywhere else leaves the first request slow."""
        if self.warm_up_batch:
            self.forward(self.warm_up_batch, [False] * len(self.warm_up_batch), alone)


def _span_means(rows: Any, pools: tuple[int, ...]) -> Any:
    """Late chunking: the mean state of each token range [a, b) of one sequence (pools
    holds a0, b0, a1, b1, ...), on the states' own device: only these rows leave it."""
    pairs = zip(pools[0::2], pools[1::2], strict=True)
    if isinstance(rows, np.ndarray):
        return np.stack([rows[a:b].mean(axis=0) for a, b in pairs])
    return torch.stack([rows[a:b].mean(dim=0) for a, b in pairs])


def _joined(rows: Sequence[Sequence[int] | np.ndarray], total: int) -> np.ndarray:
    """Rows of ids end to end: numpy arrays (an engine process's views of one message) are
    joined as arrays, Python lists (the tokenizer's) read as one stream of ints."""
    if all(isinstance(row, np.ndarray) for row in rows):
        return np.concatenate(rows)  # type: ignore[arg-type]
    return np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=total)


def _host(output: np.ndarray | torch.Tensor) -> np.ndarray:
    """Float32 numpy on the host, from a backend's array or the module's tensor."""
    if isinstance(output, np.ndarray):
        return output.astype(np.float32, copy=False)
    return output.float().cpu().numpy()


@dataclass
class LoadedModel(ServedModel):
    """A served model with the runner that computes its forward (in the engine process)."""

    runner: ModelRunner
