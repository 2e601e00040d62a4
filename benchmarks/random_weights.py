"""Give a model folder that holds only its config and tokenizer random weights, in place.

Speed depends on a model's shapes, not its weights: this lets a benchmark run on a machine
that a model's weight file cannot be copied to. Run: python -m benchmarks.random_weights DIR
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModel, AutoTokenizer, BertConfig, BertModel


def sentence_transformers_bert(
    folder: Path, minilm: Path, hidden: int, layers: int, heads: int, intermediate: int
) -> None:
    """A random-weight BERT of this shape in `folder`, with MiniLM's tokenizer and its
    sentence-transformers layout (modules.json, mean pooling at this width, Normalize), so
    that sentence-transformers and the server load it as they load MiniLM."""
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=30522,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=intermediate,
        max_position_embeddings=512,
    )
    BertModel(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(minilm).save_pretrained(folder)
    for name in ("modules.json", "sentence_bert_config.json"):
        shutil.copy(minilm / name, folder / name)
    pooling = json.loads((minilm / "1_Pooling" / "config.json").read_text())
    pooling["word_embedding_dimension"] = hidden
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2))
    (folder / "2_Normalize").mkdir(exist_ok=True)


def main(folder: str) -> None:
    torch.manual_seed(0)
    model = AutoModel.from_config(AutoConfig.from_pretrained(folder))
    model.save_pretrained(folder)
    print(f"wrote random weights for {type(model).__name__} to {folder}")


if __name__ == "__main__":
    main(sys.argv[1])
