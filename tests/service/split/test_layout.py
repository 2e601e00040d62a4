"""service/split/layout.py: what `--frontends auto` and `--engines-per-device auto` become."""

from __future__ import annotations

from pathlib import Path

import pytest

from pooling_server.service.split import layout
from pooling_server.service.split.layout import Layout, resolve

GIB = 1024**3


@pytest.mark.parametrize(
    ("gpus", "cores", "weights", "want"),
    [
        (0, 2, 0, Layout(1, 1)),  # a CPU host: one of each, as measured best there
        (0, 64, 0, Layout(1, 1)),
        (1, 16, 400 * 1024**2, Layout(4, 2)),  # the H200 host of issue 35, bge-base
        (1, 8, 100 * 1024**2, Layout(2, 1)),
        (1, 32, 100 * 1024**2, Layout(4, 4)),
        (1, 64, 100 * 1024**2, Layout(4, 4)),  # capped per device
        (1, 16, 3 * GIB, Layout(4, 1)),  # a large model: one copy of the weights
        (2, 64, 100 * 1024**2, Layout(8, 4)),
        (4, 64, 100 * 1024**2, Layout(8, 2)),  # front ends capped for the host
    ],
)
def test_auto_layout(gpus: int, cores: int, weights: int, want: Layout) -> None:
    assert resolve("auto", "auto", gpus, cores, weights) == want


def test_given_counts_are_kept_and_auto_fills_in_the_other() -> None:
    assert resolve(3, 5, gpus=0, cores=2, weights=0) == Layout(3, 5)
    assert resolve(0, "auto", gpus=1, cores=16, weights=0) == Layout(0, 1)
    assert resolve("auto", 3, gpus=1, cores=16, weights=0) == Layout(4, 3)


def test_ports_of_zero_keep_one_front_end() -> None:
    """Front ends share a fixed port; an ephemeral one cannot be shared."""
    assert resolve("auto", "auto", 1, 16, 0, fixed_ports=False) == Layout(1, 2)


def test_visible_gpus_follow_cuda_visible_devices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for bus in ("0000:01:00.0", "0000:02:00.0", "0000:03:00.0"):
        (tmp_path / bus).mkdir()
    monkeypatch.setattr(layout, "NVIDIA_GPUS", tmp_path)
    assert layout.cuda_devices("auto", {}) == 3
    assert layout.cuda_devices("cuda", {"CUDA_VISIBLE_DEVICES": "1"}) == 1
    assert layout.cuda_devices("auto", {"CUDA_VISIBLE_DEVICES": ""}) == 0
    assert layout.cuda_devices("auto", {"CUDA_VISIBLE_DEVICES": "0,-1,2"}) == 1
    assert layout.cuda_devices("cpu", {}) == 0
    monkeypatch.setattr(layout, "NVIDIA_GPUS", tmp_path / "absent")
    nodes = tmp_path / "dev"
    nodes.mkdir()
    monkeypatch.setattr(layout, "DEVICE_NODES", nodes)
    assert layout.cuda_devices("auto", {}) == 0
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):  # two GPUs, two others
        (nodes / name).touch()
    assert layout.cuda_devices("auto", {}) == 2


def test_weight_bytes_are_the_largest_local_folders(tmp_path: Path) -> None:
    small, large = tmp_path / "small", tmp_path / "large"
    for folder, size in ((small, 10), (large, 300)):
        (folder / "onnx").mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"x" * size)
        (folder / "onnx" / "model.onnx").write_bytes(b"x" * size)
        (folder / "tokenizer.json").write_bytes(b"x" * 1000)  # not weights
    assert layout.weight_bytes([str(small), str(large), "org/hub-name"]) == 600
