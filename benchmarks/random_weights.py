"""Give a model folder that holds only its config and tokenizer random weights, in place.

Speed depends on a model's shapes, not its weights: this lets a benchmark run on a machine
that a model's weight file cannot be copied to. Run: python -m benchmarks.random_weights DIR
"""

from __future__ import annotations

import sys

import torch
from transformers import AutoConfig, AutoModel


def main(folder: str) -> None:
    torch.manual_seed(0)
    model = AutoModel.from_config(AutoConfig.from_pretrained(folder))
    model.save_pretrained(folder)
    print(f"wrote random weights for {type(model).__name__} to {folder}")


if __name__ == "__main__":
    main(sys.argv[1])
