"""What the server fills in for the device (batch size cap, forward workers, torch threads)
and for gRPC core (the connection cap under the open-file limit)."""

from __future__ import annotations

import os
import resource
from collections.abc import Iterator

import pytest
import torch

from pooling_server.engine.models.model_runner import ThreadShare
from pooling_server.engine.scheduling.batch_queue import BatchConfig
from pooling_server.service.loading import batch_config_for, thread_share
from pooling_server.service.ops import config
from pooling_server.service.ops.config import ServerConfig

CPU, GPU = torch.device("cpu"), torch.device("cuda")


@pytest.fixture
def eight_cores(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_cpu_gets_two_workers_that_share_the_cores(eight_cores: None) -> None:
    config = ServerConfig()
    batch = batch_config_for(config, CPU)
    assert (batch.workers, batch.max_batch_size) == (2, 32)
    assert thread_share(config, CPU, batch.workers, 384) == ThreadShare(alone=8, shared=4)


def test_flags_win_over_the_device_defaults(eight_cores: None) -> None:
    config = ServerConfig(torch_threads=3, batch=BatchConfig(max_batch_size=8, workers=1))
    batch = batch_config_for(config, CPU)
    assert (batch.workers, batch.max_batch_size, torch.get_num_threads()) == (1, 8, 3)
    assert thread_share(config, CPU, batch.workers, 384) == ThreadShare(alone=3, shared=3)


def test_torch_threads_stand_for_the_cores_of_a_container(eight_cores: None) -> None:
    """A pod limited to 2 CPUs on an 8-core node must not run 8 threads per pass."""
    config = ServerConfig(torch_threads=2)
    batch = batch_config_for(config, CPU)
    assert batch.workers == 2
    assert thread_share(config, CPU, batch.workers, 384) == ThreadShare(alone=2, shared=1)


def test_one_core_gets_one_worker(monkeypatch: pytest.MonkeyPatch, eight_cores: None) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    config = ServerConfig()
    batch = batch_config_for(config, CPU)
    assert batch.workers == 1
    assert thread_share(config, CPU, batch.workers, 384) == ThreadShare(alone=1, shared=1)


def test_gpu_prepares_one_batch_while_another_runs(eight_cores: None) -> None:
    torch.set_num_threads(5)
    config = ServerConfig()
    batch = batch_config_for(config, GPU)
    assert (batch.workers, batch.max_batch_size) == (2, 256)
    assert thread_share(config, GPU, batch.workers, 384) is None
    assert torch.get_num_threads() == 5, "intra-op threads are left alone on a GPU"


def test_a_tiny_model_runs_its_passes_on_one_thread(eight_cores: None) -> None:
    """Its operations are too small to split; --torch-threads still decides when given."""
    config = ServerConfig()
    batch = batch_config_for(config, CPU)
    assert thread_share(config, CPU, batch.workers, 32) == ThreadShare(alone=1, shared=1)
    given = ServerConfig(torch_threads=4)
    assert thread_share(given, CPU, batch.workers, 32) == ThreadShare(alone=4, shared=2)


def test_grpc_connection_cap_takes_a_quarter_of_the_file_limit(monkeypatch, caplog) -> None:
    """--max-connections, --handshake-timeout-s and --max-connection-idle-s reach gRPC core;
    under `ulimit -n 1024` the cap is lowered to 256 (the HTTP door may take half), with a
    warning."""

    def options(soft: int) -> dict[str, int]:
        monkeypatch.setattr(config.resource, "getrlimit", lambda _: (soft, resource.RLIM_INFINITY))
        transport = config.TransportConfig(
            max_connections=1000, handshake_timeout_s=2.5, max_connection_idle_s=7.0
        )
        return dict(transport.options(16 << 20))

    roomy = options(100_000)
    assert roomy["grpc.max_allowed_incoming_connections"] == 1000
    assert roomy["grpc.server_handshake_timeout_ms"] == 2500
    assert roomy["grpc.max_connection_idle_ms"] == 7000
    assert "lowered" not in caplog.text
    assert options(1024)["grpc.max_allowed_incoming_connections"] == 256
    assert "gRPC connection cap lowered from 1000 to 256" in caplog.text
