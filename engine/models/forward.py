"""What runs a loaded model's forward: the backend chosen among those its family runs on
(engine/backends: torch, or an ONNX Runtime or OpenVINO export checked against torch), and
the int8/uint8 ranges computed through that forward where the folder ships none
(engine/models/calibration.py). Every family that serves a transformers module goes
through both (loader.py's serve_module)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import numpy as np
import torch

from pooling_server.engine.backends import BackendKind, RuntimeSettings, read_calibration
from pooling_server.engine.backends.select import ModelSource, choose_backend, model_key
from pooling_server.engine.families import LoadContext
from pooling_server.engine.families import family as family_facts
from pooling_server.engine.inputs.tokenization import TokenSequence
from pooling_server.engine.models.calibration import COMPUTED, Forward, computed_ranges
from pooling_server.engine.models.model_folder import ModelFolder
from pooling_server.engine.models.model_info import ModelInfo
from pooling_server.engine.models.model_runner import ModelRunner
from pooling_server.engine.models.model_spec import ModelSpec
from pooling_server.engine.models.served import ServedModel
from pooling_server.engine.requests.params import Task

# The start-up lines ("forward on ...", the ranges) under the name they have been logged
# with, beside the rest of the load's.
log = logging.getLogger("pooling_server.engine.models.loader")


def key_extra(spec: ModelSpec, attn_implementation: str | None) -> dict[str, Any]:
    """The settings beside the folder's files that shape the forward (cache keys)."""
    return {
        "overrides": spec.hf_overrides,
        "trust_remote_code": spec.trust_remote_code,
        "attn_implementation": attn_implementation or "",
    }


def with_computed_ranges(
    spec: ModelSpec,
    folder: ModelFolder,
    runner: ModelRunner,
    attn_implementation: str | None,
    runtime: RuntimeSettings | None,
) -> ModelInfo:
    """The runner's info with int8/uint8 ranges computed from the calibration texts (or
    read from the cache) where an embedding model's folder ships none
    (engine/models/calibration.py);
    other models' info as it was."""
    info = runner.info
    if info.calibration_ranges is not None or Task.EMBED not in info.tasks:
        return info
    if info.hidden_size != int(folder.config.hidden_size):
        # token_embed rows keep the transformer's width, which one set of ranges of the
        # projected width would not fit.
        log.info(
            "model %s: no int8/uint8 ranges computed: its Dense modules project %d to %d "
            "dimensions",
            info.name,
            int(folder.config.hidden_size),
            info.hidden_size,
        )
        return info
    texts = read_calibration(spec.backend.calibration_file, info.name)
    try:
        ranges = computed_ranges(
            ServedModel(info, folder.tokenizer),
            partial(_one_thread, runner.forward),
            texts,
            model_key(folder.path, folder.head, key_extra(spec, attn_implementation)),
            (runtime or RuntimeSettings()).cache_dir,
        )
    except Exception:  # a model that fails on some text still serves the rest
        log.warning(
            "model %s: no int8/uint8 ranges: the calibration texts failed in its forward pass",
            info.name,
            exc_info=True,
        )
        return info
    return replace(info, calibration_ranges=ranges, calibration_source=COMPUTED)


def _one_thread(
    forward: Forward,
    batch: Sequence[TokenSequence],
    keep_tokens: Sequence[bool],
) -> list[np.ndarray]:
    """A torch pass on the loading thread with one intra-op thread: with more, this thread
    would keep an OpenMP pool of its own beside the forward workers' for good, and once the
    pools hold more threads than there are cores OpenMP stops spinning between parallel
    regions, slowing every pass (see ThreadShare). One thread also skips the pool's start-up:
    MiniLM's ranges took 1.3 s on one thread against 2.9 s on two (2-core host)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return forward(batch, keep_tokens)
    finally:
        torch.set_num_threads(previous)


def choose_forward(
    folder: ModelFolder, runner: ModelRunner, context: LoadContext, family: str
) -> None:
    """Pick what runs the transformer's forward (--backend, among the backends `family`
    runs on: torch, or an ONNX Runtime or OpenVINO export checked against `runner`'s torch
    forward) and run `runner` on it, its info saying which; logged."""
    spec, tokenizer, facts = context.spec, folder.tokenizer, family_facts(family)
    source = ModelSource(
        name=spec.served_name,
        folder=folder.path,
        head=folder.head,
        torch=runner.backend,  # type: ignore[arg-type]
        dtype=context.dtype,
        inputs=lambda texts: runner.arrays(tokenizer.tokenize(texts)),
        key_extra=key_extra(spec, context.attn_implementation),
    )
    chosen = choose_backend(
        source,
        spec.backend,
        context.runtime or RuntimeSettings(),
        runner.device,
        context.dtype,
        context.threads,
        tuple(map(BackendKind, facts.backends)),
        facts.title,
    )
    del source  # an export holds its own weights
    runner.use(chosen.backend)
    info = replace(
        runner.info, backend=str(chosen.kind), precision=chosen.precision, backend_file=chosen.file
    )
    runner.info = info
    log.info(
        "model %s: forward on %s %s%s (%s)",
        info.name,
        info.backend,
        info.precision,
        f", file {info.backend_file}" if info.backend_file else "",
        chosen.how,
    )
