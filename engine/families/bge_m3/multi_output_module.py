"""The forward of a multi-output (bge-m3) model: the encoder, then its sparse and ColBERT
heads on every token, as one module whose `last_hidden_state` holds one float32 row per
token: the first token's hidden state (the dense vector) in row 0, and in every later row
relu(sparse_linear(h)) then colbert_linear(h) (the layout of
engine/families/bge_m3/multi_output.py). The
runner's paths work unchanged: CLS pooling reads row 0, the dense vector (dense-only embed
ships one row per text), keep-tokens hands back every token's row for the lexical weights
and the ColBERT matrix."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


def load_head(path: Path, in_features: int) -> torch.nn.Linear:
    """A Linear saved as its state dict ("weight", "bias"), as FlagEmbedding saves the
    heads; read with weights_only, so the file can hold tensors and nothing to run."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or "weight" not in state:
        raise ValueError(f"{path}: expected a Linear's state dict with 'weight' (and 'bias')")
    weight = state["weight"]
    if weight.dim() != 2 or weight.shape[1] != in_features:
        raise ValueError(
            f"{path}: weight of shape {tuple(weight.shape)} does not take the encoder's "
            f"{in_features} hidden states"
        )
    linear = torch.nn.Linear(in_features, weight.shape[0], bias="bias" in state)
    linear.load_state_dict({k: v for k, v in state.items() if k in ("weight", "bias")})
    return linear.float().eval()


@dataclass
class JoinedStates:
    last_hidden_state: torch.Tensor


class MultiOutputModule(torch.nn.Module):
    """The encoder and bge-m3's two token heads, in one pass (heads in float32)."""

    def __init__(
        self, body: torch.nn.Module, sparse: torch.nn.Linear, colbert: torch.nn.Linear
    ) -> None:
        super().__init__()
        if sparse.out_features != 1:
            raise ValueError(f"sparse_linear maps to {sparse.out_features} values, not 1")
        self.body = body
        self.sparse = sparse
        self.colbert = colbert
        self.config = body.config

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> JoinedStates:
        kwargs = {} if token_type_ids is None else {"token_type_ids": token_type_ids}
        states = self.body(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        hidden = states.last_hidden_state.float()
        rest = hidden[:, 1:]
        size, length, width = hidden.shape
        colbert = self.colbert.out_features
        rows = hidden.new_zeros(size, length, max(width, 1 + colbert))
        rows[:, 0, :width] = hidden[:, 0]
        rows[:, 1:, :1] = torch.relu(self.sparse(rest))
        rows[:, 1:, 1 : 1 + colbert] = self.colbert(rest)
        return JoinedStates(rows)
