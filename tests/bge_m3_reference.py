"""bge-m3's outputs and scores as its model card defines them, computed straight from
transformers' output on a folder: the reference the engine and served tests compare to."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModel, AutoTokenizer

from pooling_server.engine.requests.params import OutputWeights


class Reference:
    """The model card's formulas, on transformers' own output for the folder."""

    def __init__(self, folder: Path) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.model = AutoModel.from_pretrained(folder).eval()
        self.sparse = self._linear(folder / "sparse_linear.pt")
        self.colbert = self._linear(folder / "colbert_linear.pt")
        t = self.tokenizer
        self.unused = {t.cls_token_id, t.eos_token_id, t.sep_token_id, t.pad_token_id}
        self.unused.add(t.unk_token_id)

    @staticmethod
    def _linear(path: Path) -> torch.nn.Linear:
        state = torch.load(path, weights_only=True)
        linear = torch.nn.Linear(state["weight"].shape[1], state["weight"].shape[0])
        linear.load_state_dict(state)
        return linear

    @torch.no_grad()
    def encode(self, texts: Sequence[str]) -> list[dict[str, object]]:
        batch = self.tokenizer(list(texts), padding=True, return_tensors="pt")
        hidden = self.model(**batch).last_hidden_state
        dense = torch.nn.functional.normalize(hidden[:, 0], dim=-1)
        weights = torch.relu(self.sparse(hidden)).squeeze(-1)
        vectors = self.colbert(hidden[:, 1:]) * batch["attention_mask"][:, 1:, None]
        results = []
        for i in range(len(texts)):
            ids = batch["input_ids"][i].tolist()
            lexical: dict[int, float] = {}
            for token, weight in zip(ids, weights[i].tolist(), strict=True):
                if token in self.unused or weight <= 0:
                    continue
                lexical[token] = max(lexical.get(token, 0.0), weight)
            real = int(batch["attention_mask"][i].sum())
            matrix = torch.nn.functional.normalize(vectors[i, : real - 1], dim=-1)
            results.append(
                {
                    "dense": dense[i].numpy(),
                    "raw_dense": hidden[i, 0].numpy(),
                    "sparse": lexical,
                    "multi": matrix.numpy(),
                }
            )
        return results


def expected_score(q: dict[str, object], d: dict[str, object], w: OutputWeights | None) -> float:
    dense = float(np.dot(q["dense"], d["dense"]))  # type: ignore[call-overload]
    if w is None:
        return dense
    qs, ds = q["sparse"], d["sparse"]
    sparse = sum(weight * ds[token] for token, weight in qs.items() if token in ds)  # type: ignore[union-attr,index,attr-defined]
    products = q["multi"] @ d["multi"].T  # type: ignore[operator,union-attr]
    multi = float(products.max(axis=1).sum() / len(q["multi"]))  # type: ignore[arg-type]
    total = w.dense + w.sparse + w.multi
    return (w.dense * dense + w.sparse * sparse + w.multi * multi) / total
