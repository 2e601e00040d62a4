"""The transformer forward as a graph: the module every exporter traces, and what it is fed."""

from __future__ import annotations

import torch

from pooling_server.engine.models.model_info import HeadKind


def output_name(head: HeadKind) -> str:
    """The graph's one output, named as transformers' model outputs name it."""
    return "last_hidden_state" if head is HeadKind.HIDDEN else "logits"


class ForwardOnly(torch.nn.Module):
    """The module's forward with plain tensors in and the one tensor the runner needs out.

    Exporters trace positional tensors; transformers' forward takes keywords and returns
    a ModelOutput, and its cache must stay off so that no key/value state is traced.
    """

    def __init__(self, module: torch.nn.Module, head: HeadKind) -> None:
        super().__init__()
        self.module = module
        self.output = output_name(head)
        if hasattr(module, "config"):
            module.config.use_cache = False

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if token_type_ids is not None:
            inputs["token_type_ids"] = token_type_ids
        return getattr(self.module(**inputs, return_dict=True), self.output)
