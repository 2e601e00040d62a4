"""The loop-bound model: a 1-layer, hidden-32 BERT with random weights, MiniLM's tokenizer and
pooling layout.

Its forward pass costs next to nothing, so the server's rate on it is set by the server's own
per-request work (gRPC, event loop, tokenize hand-off, batching), which is what changes to the
server can move. Built in a temp folder so no weight file has to be shipped, in a process of
its own (`python -m benchmarks.loop_bound FOLDER`) so the measuring process never imports
torch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks.workload import _default_model_path

HIDDEN = 32


def build(folder: str) -> dict[str, str]:
    from benchmarks.random_weights import sentence_transformers_bert

    sentence_transformers_bert(Path(folder), _default_model_path(), HIDDEN, 1, 2, intermediate=37)
    return {"folder": folder}


if __name__ == "__main__":
    print(json.dumps(build(sys.argv[1])))
