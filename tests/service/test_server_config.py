"""What the server fills in for the device: batch size cap, forward workers, torch threads."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from engine.batch_queue import BatchConfig
from service.server import ServerConfig, batch_config_for


@pytest.fixture
def eight_cores(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_cpu_shares_the_cores_among_two_single_batch_workers(eight_cores: None) -> None:
    batch = batch_config_for(ServerConfig(), torch.device("cpu"))
    assert (batch.workers, batch.max_batch_size, torch.get_num_threads()) == (2, 32, 4)


def test_flags_win_over_the_device_defaults(eight_cores: None) -> None:
    config = ServerConfig(torch_threads=3, batch=BatchConfig(max_batch_size=8, workers=1))
    batch = batch_config_for(config, torch.device("cpu"))
    assert (batch.workers, batch.max_batch_size, torch.get_num_threads()) == (1, 8, 3)


def test_one_core_gets_one_worker(monkeypatch: pytest.MonkeyPatch, eight_cores: None) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    batch = batch_config_for(ServerConfig(), torch.device("cpu"))
    assert (batch.workers, torch.get_num_threads()) == (1, 1)


def test_gpu_prepares_one_batch_while_another_runs(eight_cores: None) -> None:
    torch.set_num_threads(5)
    batch = batch_config_for(ServerConfig(), torch.device("cuda"))
    assert (batch.workers, batch.max_batch_size) == (2, 256)
    assert torch.get_num_threads() == 5, "intra-op threads are left alone on a GPU"
