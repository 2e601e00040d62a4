"""A local Ray cluster for one test module, and what the Ray tests share."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

ray = pytest.importorskip("ray", reason="ray[data] is in requirements.txt; `make venv` installs it")

OBJECT_STORE_BYTES = 200 << 20
# Logical CPUs: each actor asks for CPU_PER_ACTOR, so two actors and Ray Data's own tasks fit.
CLUSTER_CPUS = 4
CPU_PER_ACTOR = 1


def start_cluster() -> Iterator[str]:
    """A Ray started in this process (ray.init) for the module; yields its GCS address, which
    `pooling-server batch --ray ADDRESS` subprocesses join as drivers of their own."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(
        num_cpus=CLUSTER_CPUS,
        object_store_memory=OBJECT_STORE_BYTES,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    context.execution_options.preserve_order = True
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
