"""A decoder LM reduced to a pair scorer: two rows of its LM head at the last position.

Qwen3-Reranker reads the logits of "yes" and "no" for the token after the template. The
full head would cost a vocabulary-wide row (151k for Qwen3) per position; only the two
rows matter, and only at each sequence's last real token, so this module keeps the decoder
body and a float32 copy of those two rows: the causal LM around them, and with it an untied
head's full matrix, is let go once they are copied.

Batches are right-padded (ModelRunner.arrays): with causal attention no real token ever
attends to a pad, and each row keeps positions 0..n-1, exactly as when it runs alone; the
last real token is read at `attention_mask.sum(1) - 1`. (Left padding, as the model card's
reference uses, shifts every position of a short row; rotary embeddings make that shift
vanish only up to rounding.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PairLogits:
    """What the runner reads: `logits` [batch, 1], logit(true) - logit(false)."""

    logits: torch.Tensor


class LlmScorer(torch.nn.Module):
    """The decoder body and the true/false rows of its LM head."""

    def __init__(self, causal_lm: torch.nn.Module, true_id: int, false_id: int) -> None:
        super().__init__()
        self.body = causal_lm.get_decoder()
        head = causal_lm.get_output_embeddings()
        rows = head.weight.detach()[[true_id, false_id]].float().clone()
        self.register_buffer("rows", rows, persistent=False)
        bias = getattr(head, "bias", None)
        two = bias.detach()[[true_id, false_id]].float().clone() if bias is not None else None
        self.register_buffer("bias", two, persistent=False)
        config = causal_lm.config
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        # Gemma 2's soft cap of the logits; a few families scale them.
        self.softcap = getattr(text, "final_logit_softcapping", None)
        self.scale = float(getattr(text, "logits_scaling", 1.0) or 1.0)
        self.config = config

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **_: object
    ) -> PairLogits:
        states = self.body(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False
        ).last_hidden_state
        last = (attention_mask.sum(dim=1) - 1).clamp(min=0)
        rows = torch.arange(states.shape[0], device=states.device)
        hidden = states[rows, last].float()
        logits = hidden @ self.rows.T
        if self.bias is not None:
            logits = logits + self.bias
        logits = logits / self.scale
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return PairLogits((logits[:, 0] - logits[:, 1]).unsqueeze(1))
