"""What the engine tests of one model kind share: a folder loaded on the CPU in float32,
and requests run as the engine runs them (validated, planned, forwarded, finished) without
a queue, so a test sees the outputs of exactly the batch it built."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from pooling_server.engine.models.loader import LoadedModel, load_model
from pooling_server.engine.models.model_spec import ModelSpec
from pooling_server.engine.requests.outputs import ItemOutput
from pooling_server.engine.requests.plans import Plan, plan_request
from pooling_server.engine.requests.request import PoolRequest
from pooling_server.engine.requests.resolved import Limits
from pooling_server.engine.requests.validation import validate_request


def load(folder: Path, name: str | None = None, **options: object) -> LoadedModel:
    """The folder served as `name` (default: the folder's name), with ModelSpec `options`."""
    spec = ModelSpec(str(folder), name=name or folder.name, **options)  # type: ignore[arg-type]
    return load_model(spec, device=torch.device("cpu"), dtype=torch.float32)


def run_all(model: LoadedModel, requests: Sequence[PoolRequest]) -> list[list[ItemOutput]]:
    """Every request planned, then all their inputs in ONE forward pass (a mixed batch),
    each request's outputs finished from its own slice of the rows."""
    limits = Limits()
    plans: list[Plan] = [
        plan_request(validate_request(r, model.info, limits), model, limits) for r in requests
    ]
    work = [item for plan in plans for item in plan.work]
    raws = model.runner.forward([s for s, _ in work], [keep for _, keep in work])
    results, start = [], 0
    for plan in plans:
        results.append(plan.finish(raws[start : start + len(plan.work)]))
        start += len(plan.work)
    return results
