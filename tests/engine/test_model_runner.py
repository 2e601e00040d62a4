"""The runner's intra-op threads: every core for a lone forward pass, a share beside another."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch

from pooling_server.engine.models.loader import ModelSpec, load_model
from pooling_server.engine.models.model_runner import ThreadShare


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


def test_padded_arrays_are_the_rows_padded_one_by_one() -> None:
    """`arrays` fills every row at once: the same arrays as a row at a time, whether the ids
    are the tokenizer's lists or an engine process's numpy views, with and without types."""
    import numpy as np

    from pooling_server.engine.inputs.tokenization import TokenSequence
    from pooling_server.engine.models.model_runner import ModelRunner

    rng = np.random.default_rng(0)
    runner = ModelRunner.__new__(ModelRunner)
    runner.pad_token_id, runner.fills_token_types = 7, False
    for with_types in (False, True):
        runner.accepts_token_type_ids = with_types
        for as_array in (False, True):
            lengths = [int(n) for n in rng.integers(0, 30, size=17)] + [1]
            batch = []
            for n in lengths:
                ids, types = rng.integers(100, 999, size=n), rng.integers(0, 2, size=n)
                if not as_array:
                    ids, types = ids.tolist(), types.tolist()
                batch.append(TokenSequence(ids, types, [], []))  # type: ignore[arg-type]
            arrays = runner.arrays(batch)
            longest = max(lengths)
            expected_ids = np.full((len(batch), longest), 7, dtype=np.int64)
            expected_mask = np.zeros((len(batch), longest), dtype=np.int64)
            expected_types = np.zeros((len(batch), longest), dtype=np.int64)
            for row, sequence in enumerate(batch):
                n = len(sequence)
                expected_ids[row, :n] = sequence.input_ids
                expected_mask[row, :n] = 1
                expected_types[row, :n] = sequence.token_type_ids  # type: ignore[assignment]
            assert sorted(arrays) == sorted(
                ["input_ids", "attention_mask", *(["token_type_ids"] if with_types else [])]
            )
            assert arrays["input_ids"].dtype == arrays["attention_mask"].dtype == np.int64
            np.testing.assert_array_equal(arrays["input_ids"], expected_ids)
            np.testing.assert_array_equal(arrays["attention_mask"], expected_mask)
            if with_types:
                np.testing.assert_array_equal(arrays["token_type_ids"], expected_types)
