"""The forward of a multi-vector model: the transformer and its token projection as one
module whose `last_hidden_state` is the projected states, so the runner's keep-tokens path
hands back one row per token unchanged."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from tokenizers import AddedToken

from pooling_server.engine.families.colbert.multi_vector import MultiVectorSettings


def load_projection(folder: Path) -> torch.nn.Linear:
    """The Dense module on token states: a linear map (ColBERT saves it without bias or
    activation; an activation other than identity is refused rather than ignored)."""
    config = json.loads((folder / "config.json").read_text())
    activation = config.get("activation_function") or "torch.nn.modules.linear.Identity"
    if activation.rsplit(".", 1)[-1] != "Identity":
        raise ValueError(
            f"{folder}: a multi-vector Dense with activation {activation} is not supported"
        )
    linear = torch.nn.Linear(
        int(config["in_features"]), int(config["out_features"]), bias=bool(config.get("bias", True))
    )
    if (folder / "model.safetensors").is_file():
        weights = load_file(folder / "model.safetensors")
    elif (folder / "pytorch_model.bin").is_file():  # older PyLate saves
        weights = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"{folder}: a Dense module without model.safetensors or pytorch_model.bin")
    linear.load_state_dict({k.removeprefix("linear."): v for k, v in weights.items()})
    return linear.float().eval()


@dataclass
class ProjectedStates:
    last_hidden_state: torch.Tensor


class MultiVectorModule(torch.nn.Module):
    """The transformer, then the projection of every token state (in float32).

    Query expansion without attention: the trailing run of mask tokens (after [SEP]) is
    left out of the attention mask, so no token attends to it, while its own states are
    still computed and returned, as sentence-transformers' expansion does."""

    def __init__(
        self, body: torch.nn.Module, projection: torch.nn.Linear, settings: MultiVectorSettings
    ) -> None:
        super().__init__()
        self.body = body
        self.projection = projection
        self.config = body.config
        self.hide_expansion = settings.query_expansion and not settings.attend_to_expansion
        self.mask_token_id = settings.mask_token_id

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> ProjectedStates:
        if self.hide_expansion:
            filler = (input_ids == self.mask_token_id) | (attention_mask == 0)
            trailing = torch.flip(torch.cumprod(torch.flip(filler.long(), [1]), 1), [1])
            attention_mask = attention_mask * (1 - trailing)
        kwargs = {} if token_type_ids is None else {"token_type_ids": token_type_ids}
        states = self.body(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        return ProjectedStates(self.projection(states.last_hidden_state.float()))


def register_prefixes(tokenizer: Any, prefixes: Sequence[str]) -> None:
    """Make marker prefixes single tokens, as MultiVectorEncoder does on load: a prefix
    (or its first word) that the vocabulary holds, e.g. BERT's "[unused0]", but that the
    tokenizer would split into pieces becomes a special added token."""
    added = set(tokenizer.get_added_vocab())
    vocab = tokenizer.get_vocab()
    register = []
    for value in prefixes:
        if not value or not value.split():
            continue
        for prefix in (value, value.split(None, 1)[0]):
            if prefix not in added and prefix not in vocab:
                continue
            if tokenizer.tokenize(prefix) != [prefix]:
                register.append(AddedToken(prefix, normalized=False, special=True))
            break
    if register:
        tokenizer.add_special_tokens({"additional_special_tokens": register})
