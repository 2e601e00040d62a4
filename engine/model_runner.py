"""One forward pass over a padded batch, returning each sequence's raw output on the CPU."""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import numpy as np
import torch

from engine.model_info import HeadKind, ModelInfo
from engine.pooling import pool
from engine.tokenization import Encoding


class ModelRunner:
    """Runs a transformers module; the queue's worker threads may call it at once.

    Per sequence it returns: HIDDEN head, the pooled vector (or every token's state
    when `keep_tokens`); SEQUENCE head, the logits; TOKEN head, the logits per token.
    """

    def __init__(
        self, module: torch.nn.Module, info: ModelInfo, pad_token_id: int, device: torch.device
    ) -> None:
        self.module = module
        self.info = info
        self.pad_token_id = pad_token_id
        self.device = device
        # Decoders get no token_type_ids even when the tokenizer makes them.
        self.accepts_token_type_ids = (
            "token_type_ids" in inspect.signature(module.forward).parameters
        )

    def collate(self, batch: Sequence[Encoding]) -> dict[str, torch.Tensor]:
        """Right-pad to the longest sequence; pinned memory speeds the copy to a GPU."""
        longest = max(len(e) for e in batch)
        ids = torch.full((len(batch), longest), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        with_types = self.accepts_token_type_ids and all(
            e.token_type_ids is not None for e in batch
        )
        types = torch.zeros((len(batch), longest), dtype=torch.long) if with_types else None
        for row, encoding in enumerate(batch):
            n = len(encoding)
            ids[row, :n] = torch.tensor(encoding.input_ids, dtype=torch.long)
            mask[row, :n] = 1
            if types is not None:
                types[row, :n] = torch.tensor(encoding.token_type_ids, dtype=torch.long)
        inputs = {"input_ids": ids, "attention_mask": mask}
        if types is not None:
            inputs["token_type_ids"] = types
        if self.device.type == "cuda":
            return {k: v.pin_memory().to(self.device, non_blocking=True) for k, v in inputs.items()}
        return inputs

    @torch.inference_mode()
    def forward(self, batch: Sequence[Encoding], keep_tokens: Sequence[bool]) -> list[np.ndarray]:
        inputs = self.collate(batch)
        output = self.module(**inputs)
        lengths = [len(e) for e in batch]
        if self.info.head is HeadKind.SEQUENCE:
            logits = output.logits.float().cpu().numpy()
            return [logits[i] for i in range(len(batch))]
        if self.info.head is HeadKind.TOKEN:
            logits = output.logits.float().cpu().numpy()
            return [logits[i, :n] for i, n in enumerate(lengths)]
        hidden = output.last_hidden_state.float()
        pooled = pool(hidden, inputs["attention_mask"], self.info.pooling_type).cpu().numpy()
        tokens = hidden.cpu().numpy() if any(keep_tokens) else None
        return [
            tokens[i, :n] if keep and tokens is not None else pooled[i]
            for i, (n, keep) in enumerate(zip(lengths, keep_tokens, strict=True))
        ]

    def warm_up(self, batch: Sequence[Encoding]) -> None:
        self.forward(batch, [False] * len(batch))
