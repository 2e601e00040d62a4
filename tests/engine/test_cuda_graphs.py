"""CUDA graphs for the forward pass (engine/models/cuda_graphs.py), without a GPU.

The bucket policy is pure Python. The copy-in, padding and slice-out around a replay run
on the CPU through `eager_capture`, a stand-in graph whose replay runs the real
transformers module on the static tensors: padding a batch to its bucket must not change
what the runner answers. Capture and replay on CUDA itself are not tested here.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from pooling_server.engine.models.cuda_graphs import (
    Buckets,
    GraphedForward,
    GraphSettings,
    eager_capture,
    select_shapes,
    why_eager,
)
from pooling_server.engine.models.loader import LoadedModel, ModelSpec, load_model
from pooling_server.engine.scheduling.batch_queue import BatchConfig
from pooling_server.service.cli import config_from_args, parse_args
from pooling_server.service.loading import graph_settings

CPU = torch.device("cpu")

TEXTS = [
    "a",
    "a short text",
    "a somewhat longer text, with a few more words in it than the others",
]


@pytest.mark.parametrize(
    ("batch", "bucket"),
    [
        ((1, 1), (1, 16)),
        ((1, 16), (1, 16)),  # exactly on the boundary
        ((1, 17), (1, 32)),
        ((3, 16), (4, 16)),
        ((4, 33), (4, 64)),
        ((5, 100), (8, 128)),
        ((256, 512), (256, 512)),
        ((257, 16), None),  # more rows than the largest batch
        ((1, 513), None),  # longer than the longest bucket
    ],
)
def test_the_smallest_bucket_that_holds_the_batch(
    batch: tuple[int, int], bucket: tuple[int, int] | None
) -> None:
    buckets = Buckets.for_model(max_batch_size=256, max_input_tokens=512)
    assert buckets.choose(*batch) == bucket


def test_buckets_are_capped_at_the_largest_batch_and_the_longest_input() -> None:
    buckets = Buckets.for_model(max_batch_size=48, max_input_tokens=100)
    assert buckets.batch_sizes == (1, 2, 4, 8, 16, 32, 48)
    assert buckets.lengths == (16, 32, 64, 100)
    assert buckets.choose(48, 100) == (48, 100)
    assert buckets.choose(33, 65) == (48, 100)
    assert buckets.choose(49, 10) is None
    assert buckets.choose(1, 101) is None
    # A model that takes 8192 tokens gets graphs up to max_length only.
    long_model = Buckets.for_model(max_batch_size=8, max_input_tokens=8192, max_length=256)
    assert long_model.lengths == (16, 32, 64, 128, 256)
    assert long_model.choose(1, 256) == (1, 256)
    assert long_model.choose(1, 257) is None


def test_shapes_no_batch_can_reach_under_the_token_cap_get_no_graph() -> None:
    buckets = Buckets.for_model(256, 512, max_batch_tokens=16384)
    assert (256, 512) not in buckets.shapes
    assert (128, 512) not in buckets.shapes  # 65 rows of 257 tokens: 16705 padded
    assert (64, 512) in buckets.shapes  # 33 x 257 = 8481
    assert (1, 512) in buckets.shapes  # a lone sequence may pass the cap
    assert buckets.choose(200, 300) is None  # eager
    # Every batch the batcher can form has its graph.
    missing = [
        (b, n)
        for b in range(1, 257)
        for n in range(1, 513)
        if (b == 1 or b * n <= 16384) and buckets.choose(b, n) is None
    ]
    assert missing == []
    assert len(buckets.shapes) < len(buckets.batch_sizes) * len(buckets.lengths)


def test_shapes_are_taken_smallest_first_within_the_output_budget() -> None:
    shapes = [(1, 16), (1, 32), (2, 16), (2, 32), (4, 32)]
    chosen = select_shapes(shapes, lambda s: s[0] * s[1], budget=16 + 32 + 32 + 64)
    assert chosen == [(1, 16), (1, 32), (2, 16), (2, 32)]
    assert select_shapes(shapes, lambda s: s[0] * s[1], budget=15) == []


def _load(folders: dict[str, Path], name: str) -> LoadedModel:
    return load_model(
        ModelSpec(source=str(folders[name]), name=name), device=CPU, dtype=torch.float32
    )


def _graphed(model: LoadedModel, max_batch_size: int = 4, max_length: int = 64) -> GraphedForward:
    runner = model.runner
    assert runner.module is not None
    buckets = Buckets.for_model(max_batch_size, runner.info.max_input_tokens, max_length)
    graphs = GraphedForward(
        runner.module,
        runner._output,
        buckets,
        CPU,
        runner.pad_token_id,
        runner.accepts_token_type_ids,
        capture=eager_capture,
    )
    graphs.capture_all()
    return graphs


def _same(got: list[np.ndarray], expected: list[np.ndarray]) -> None:
    assert [a.shape for a in got] == [b.shape for b in expected]
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("name", "keep_tokens"),
    [
        ("tiny-bert", False),  # CLS pooling
        ("tiny-bert", True),  # every token's state, sliced to each sequence
        ("tiny-st-mean", False),  # mean pooling over the real mask
        ("tiny-classifier", False),  # [batch, labels] logits
        ("tiny-ner", False),  # logits per token
        ("tiny-decoder", False),  # causal, last-token pooling
    ],
)
def test_a_batch_padded_to_its_bucket_answers_as_eager(
    model_folders: dict[str, Path], name: str, keep_tokens: bool
) -> None:
    model = _load(model_folders, name)
    runner = model.runner
    batch = model.tokenizer.tokenize(TEXTS)
    assert len({len(s) for s in batch}) == 3  # rows of padding, as well as columns
    keep = [keep_tokens] * len(batch)
    eager = runner.forward(batch, keep)
    graphs = _graphed(model)
    shape = graphs.buckets.choose(len(batch), max(len(s) for s in batch))
    assert shape is not None and shape[0] > len(batch) and shape[1] > max(len(s) for s in batch)
    runner.graphs = graphs
    _same(runner.forward(batch, keep), eager)
    assert graphs.replays == 1
    # Rows past the batch (a lone pad token each) leave nothing that is not a number. (On
    # the CPU transformers keeps even a fully masked row finite: the lone token guards
    # CUDA's SDPA kernels, which this cannot check.)
    assert torch.isfinite(graphs.graphs[shape].output).all()


def test_token_types_of_pairs_reach_the_graph(model_folders: dict[str, Path]) -> None:
    model = _load(model_folders, "tiny-cross-encoder")
    runner = model.runner
    batch = model.tokenizer.tokenize(["a query", "another query"], ["a passage", "a document"])
    assert batch[0].token_type_ids is not None and any(batch[0].token_type_ids)
    eager = runner.forward(batch, [False, False])
    runner.graphs = _graphed(model)
    _same(runner.forward(batch, [False, False]), eager)
    assert runner.graphs.replays == 1


def test_shapes_outside_the_buckets_run_eagerly(model_folders: dict[str, Path]) -> None:
    model = _load(model_folders, "tiny-st-mean")
    runner = model.runner
    too_many = model.tokenizer.tokenize(TEXTS * 2)  # 6 rows, the largest bucket is 4
    too_long = model.tokenizer.tokenize([" ".join(["word"] * 80)])  # past 64 tokens
    assert len(too_long[0]) > 64
    expected = [runner.forward(b, [False] * len(b)) for b in (too_many, too_long)]
    graphs = _graphed(model)
    runner.graphs = graphs
    for batch, eager in zip((too_many, too_long), expected, strict=True):
        _same(runner.forward(batch, [False] * len(batch)), eager)
    assert graphs.replays == 0
    runner.forward(too_many[:2], [False, False])
    assert graphs.replays == 1


def test_larger_shapes_are_captured_first(model_folders: dict[str, Path]) -> None:
    model = _load(model_folders, "tiny-bert")
    runner = model.runner
    assert runner.module is not None
    captured: list[tuple[int, int]] = []

    def recording(run):  # type: ignore[no-untyped-def]
        replay, output = eager_capture(run)
        captured.append(tuple(output.shape[:2]))
        return replay, output

    buckets = Buckets.for_model(4, runner.info.max_input_tokens, 64)
    graphs = GraphedForward(
        runner.module, runner._output, buckets, CPU, runner.pad_token_id, True, recording
    )
    stats = graphs.capture_all()
    assert stats.graphs == len(captured) == 9
    sizes = [b * n for b, n in captured]
    assert sizes == sorted(sizes, reverse=True)
    assert stats.static_bytes == sum(b * n * 32 * 4 for b, n in captured)
    # An output budget that holds the smallest shapes only leaves the rest eager.
    small = GraphedForward(
        runner.module, runner._output, buckets, CPU, runner.pad_token_id, True, eager_capture
    )
    stats = small.capture_all(max_output_bytes=(1 * 16 + 1 * 32) * 32 * 4)
    assert stats.shapes == ((1, 16), (1, 32)) and stats.left_eager == 7
    assert small.buckets.choose(2, 16) is None and small.buckets.choose(1, 33) is None


def test_two_workers_never_replay_into_each_others_batch(model_folders: dict[str, Path]) -> None:
    model = _load(model_folders, "tiny-st-mean")
    runner = model.runner
    batches = [model.tokenizer.tokenize(TEXTS[:2]), model.tokenizer.tokenize(["b", "another"])]
    expected = [runner.forward(b, [False, False]) for b in batches]
    runner.graphs = _graphed(model)
    assert len({runner.graphs.buckets.choose(2, max(map(len, b))) for b in batches}) == 1
    failures: list[int] = []

    def work(k: int) -> None:
        for _ in range(30):
            got = runner.forward(batches[k], [False, False], alone=False)
            if not all(np.allclose(a, b, atol=1e-5) for a, b in zip(got, expected[k], strict=True)):
                failures.append(k)

    threads = [threading.Thread(target=work, args=(k,)) for k in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert runner.graphs.replays == 60


def test_graphs_apply_to_the_torch_forward_on_cuda_only() -> None:
    settings = GraphSettings()
    cuda = torch.device("cuda:1")
    assert why_eager(settings, cuda, torch_forward=True, attention="sdpa") is None
    assert why_eager(settings, cuda, torch_forward=True, attention="eager") is None
    assert why_eager(None, cuda, torch_forward=True) == "--cuda-graphs off"
    assert "cpu" in str(why_eager(settings, CPU, torch_forward=True))
    assert "backend" in str(why_eager(settings, cuda, torch_forward=False))  # onnx, openvino
    assert "flash" in str(why_eager(settings, cuda, True, attention="flash_attention_2"))


def test_a_cpu_device_loads_without_graphs(model_folders: dict[str, Path]) -> None:
    model = load_model(
        ModelSpec(source=str(model_folders["tiny-bert"]), name="tiny-bert"),
        device=CPU,
        dtype=torch.float32,
        cuda_graphs=GraphSettings(),
    )
    assert model.runner.graphs is None


def test_the_flag_is_on_by_default_and_off_means_no_graphs() -> None:
    batch = BatchConfig(max_batch_size=64, max_batch_tokens=8192)
    on = config_from_args(parse_args([], {}))
    assert on.cuda_graphs is True
    assert graph_settings(on, batch) == GraphSettings(max_batch_size=64, max_batch_tokens=8192)
    off = config_from_args(parse_args(["--cuda-graphs", "off"], {}))
    assert off.cuda_graphs is False
    assert graph_settings(off, batch) is None
    assert config_from_args(parse_args(["--cuda-graphs", "on"], {})).cuda_graphs is True
    with pytest.raises(SystemExit):
        parse_args(["--cuda-graphs", "maybe"], {})


def _on_a_pretend_gpu(model: LoadedModel) -> None:
    """The runner says cuda, so the loader's checks pass; its tensors stay on the CPU."""
    model.runner.device = torch.device("cuda")


def test_the_loader_captures_the_buckets_of_the_batchers_caps(
    model_folders: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    import pooling_server.engine.models.loader as loader

    model = _load(model_folders, "tiny-cross-encoder")
    runner = model.runner
    batch = model.tokenizer.tokenize(["a query"], ["a passage"])
    eager = runner.forward(batch, [False])

    def on_cpu(*args: object) -> GraphedForward:
        return GraphedForward(*args[:3], CPU, *args[4:], capture=eager_capture)  # type: ignore[arg-type]

    monkeypatch.setattr(loader, "GraphedForward", on_cpu)
    _on_a_pretend_gpu(model)
    caplog.set_level("INFO", logger="pooling_server.engine.models.loader")
    settings = GraphSettings(max_batch_size=4, max_batch_tokens=48, max_length=32)
    loader._attach_graphs(runner, settings, model.tokenizer.uses_token_type_ids)
    runner.device = CPU
    graphs = runner.graphs
    assert graphs is not None and graphs.stats is not None
    assert graphs.buckets.batch_sizes == (1, 2, 4) and graphs.buckets.lengths == (16, 32)
    assert (4, 32) not in graphs.buckets.shapes  # 3 rows of 17 tokens pass 48
    assert graphs.stats.graphs == 5
    assert "token_type_ids" in graphs.graphs[(1, 16)].inputs
    assert (
        "5 CUDA graphs captured" in caplog.text
        and "batch sizes 1,2,4 x lengths 16,32" in caplog.text
    )
    _same(runner.forward(batch, [False]), eager)
    assert graphs.replays == 1


def test_a_capture_that_fails_leaves_the_forward_eager(
    model_folders: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    import pooling_server.engine.models.loader as loader

    model = _load(model_folders, "tiny-bert")

    def fails(self: GraphedForward, max_output_bytes: int = 0) -> None:
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(GraphedForward, "__init__", lambda self, *args: None)
    monkeypatch.setattr(GraphedForward, "capture_all", fails)
    _on_a_pretend_gpu(model)
    loader._attach_graphs(model.runner, GraphSettings(), True)
    assert model.runner.graphs is None
    assert "CUDA graph capture failed" in caplog.text
    # Off: no capture at all, said in the log.
    caplog.clear()
    caplog.set_level("INFO", logger="pooling_server.engine.models.loader")
    loader._attach_graphs(model.runner, None, True)
    assert "no CUDA graphs (--cuda-graphs off)" in caplog.text
