"""One forward pass over a padded batch, returning each sequence's raw output on the CPU."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.model_info import HeadKind, ModelInfo
from engine.pooling import pool, splade
from engine.tokenization import Encoding


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
    when `keep_tokens`); SEQUENCE head, the logits; TOKEN head, the logits per token;
    SPARSE head, the SPLADE-pooled vocabulary vector (see pooling.splade).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        info: ModelInfo,
        pad_token_id: int,
        device: torch.device,
        warm_up_batch: Sequence[Encoding] = (),
        projection: torch.nn.Module | None = None,
    ) -> None:
        """`projection`: sentence-transformers' Dense modules, applied to pooled vectors."""
        self.module = module
        self.projection = projection
        self.warm_up_batch = list(warm_up_batch)
        self.info = info
        self.pad_token_id = pad_token_id
        self.device = device
        # Decoders get no token_type_ids even when the tokenizer makes them.
        self.accepts_token_type_ids = (
            "token_type_ids" in inspect.signature(module.forward).parameters
        )
        self.threads: ThreadShare | None = None  # None: leave torch's setting alone

    def collate(self, batch: Sequence[Encoding]) -> dict[str, torch.Tensor]:
        """Right-pad to the longest sequence; pinned memory speeds the copy to a GPU.

        Rows are filled in numpy and wrapped without a copy: a tensor per row costs more
        than the forward pass of a small model.
        """
        longest = max(len(e) for e in batch)
        ids = np.full((len(batch), longest), self.pad_token_id, dtype=np.int64)
        mask = np.zeros((len(batch), longest), dtype=np.int64)
        with_types = self.accepts_token_type_ids and all(
            e.token_type_ids is not None for e in batch
        )
        types = np.zeros((len(batch), longest), dtype=np.int64) if with_types else None
        for row, encoding in enumerate(batch):
            n = len(encoding)
            ids[row, :n] = encoding.input_ids
            mask[row, :n] = 1
            if types is not None:
                types[row, :n] = encoding.token_type_ids
        inputs = {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask)}
        if types is not None:
            inputs["token_type_ids"] = torch.from_numpy(types)
        if self.device.type == "cuda":
            return {k: v.pin_memory().to(self.device, non_blocking=True) for k, v in inputs.items()}
        return inputs

    def forward(
        self, batch: Sequence[Encoding], keep_tokens: Sequence[bool], alone: bool = True
    ) -> list[np.ndarray]:
        """`alone`: no other forward pass runs beside this one (see ThreadShare)."""
        if self.threads is not None:
            torch.set_num_threads(self.threads.alone if alone else self.threads.shared)
        return self._forward(batch, keep_tokens)

    @torch.inference_mode()
    def _forward(self, batch: Sequence[Encoding], keep_tokens: Sequence[bool]) -> list[np.ndarray]:
        inputs = self.collate(batch)
        output = self.module(**inputs)
        lengths = [len(e) for e in batch]
        if self.info.head is HeadKind.SEQUENCE:
            logits = output.logits.float().cpu().numpy()
            return [logits[i] for i in range(len(batch))]
        if self.info.head is HeadKind.TOKEN:
            logits = output.logits.float().cpu().numpy()
            return [logits[i, :n] for i, n in enumerate(lengths)]
        if self.info.head is HeadKind.SPARSE:
            info = self.info
            mask = inputs["attention_mask"]
            weights = splade(output.logits, mask, info.splade_strategy, info.splade_activation)
            vocab = weights.cpu().numpy()
            return [vocab[i] for i in range(len(batch))]
        hidden = output.last_hidden_state.float()
        pooled_states = pool(hidden, inputs["attention_mask"], self.info.pooling_type)
        if self.projection is not None:
            pooled_states = self.projection(pooled_states)
        pooled = pooled_states.cpu().numpy()
        tokens = hidden.cpu().numpy() if any(keep_tokens) else None
        return [
            tokens[i, :n] if keep and tokens is not None else pooled[i]
            for i, (n, keep) in enumerate(zip(lengths, keep_tokens, strict=True))
        ]

    def warm_up(self, alone: bool = True) -> None:
        """Run once on the thread that will serve: torch's thread pools, and CUDA's handles,
        belong to the calling thread, so warming anywhere else leaves the first request slow."""
        if self.warm_up_batch:
            self.forward(self.warm_up_batch, [False] * len(self.warm_up_batch), alone)
