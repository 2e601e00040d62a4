"""The runner's intra-op threads: every core for a lone forward pass, a share beside another."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch

from engine.loader import ModelSpec, load_model
from engine.model_runner import ThreadShare


def test_a_lone_pass_takes_every_core_and_one_beside_another_a_share(
    model_folders: dict[str, Path],
) -> None:
    model = load_model(
        ModelSpec(source=str(model_folders["tiny-bert"]), name="tiny-bert"),
        device=torch.device("cpu"),
        dtype=torch.float32,
    )
    runner = model.runner
    runner.threads = ThreadShare(alone=2, shared=1)
    inner = runner.module
    seen: list[int] = []

    class Recording(torch.nn.Module):
        def forward(self, **inputs: Any) -> Any:
            seen.append(torch.get_num_threads())
            return inner(**inputs)

    runner.module = Recording()
    batch = model.tokenizer.tokenize(["a short text"])

    def on_a_new_thread(alone: bool) -> None:
        thread = threading.Thread(target=runner.forward, args=(batch, [False], alone))
        thread.start()
        thread.join()

    on_a_new_thread(alone=True)
    on_a_new_thread(alone=False)
    runner.forward(batch, [False], alone=True)
    assert seen == [2, 1, 2]
