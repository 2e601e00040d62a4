"""int8/uint8 calibration ranges computed at load, for an embedding model whose folder
ships none (see engine/requests/encodings.py for the shipped ones).

As sentence-transformers' quantize_embeddings does with calibration embeddings: the
calibration texts (engine/backends/calibration.txt, or the model's --calibration-file)
are embedded with the model's own default embed (its prompt, pooling, Dense modules and
default normalisation, through the same planning code a request takes), and each
dimension's minimum and maximum over them is its range. Ranges cover the full width;
like shipped ones, they encode full-width vectors only (validation refuses other
`dimensions` with int8/uint8).

The ranges are cached under --backend-cache-dir beside the backends' exports, keyed as
they are (engine.backends.select.model_key: the folder's files, head, versions), plus the
forward that computed them, the settings that shape the vectors and the texts, so a second
start reads them instead of computing. A lock lets engine processes loading the same model
compute them once.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pooling_server.engine.backends import default_cache_dir
from pooling_server.engine.backends.select import hashed
from pooling_server.engine.inputs.tokenization import TokenSequence
from pooling_server.engine.models.served import ServedModel
from pooling_server.engine.requests.params import PoolingParams, Task
from pooling_server.engine.requests.plans import plan_request
from pooling_server.engine.requests.request import PoolRequest

log = logging.getLogger(__name__)

RANGES_FORMAT = 1  # bump when the computation changes, to leave old cache entries behind
BATCH = 32  # texts per forward pass
MAX_TOKENS = 128  # calibration texts are cut to this many tokens

# Where ModelInfo.calibration_ranges came from (ModelCard.calibration_source).
FOLDER = "folder"
COMPUTED = "computed"

# Observable in tests: how each model's computed ranges were obtained in this process.
EVENTS: list[tuple[str, str]] = []  # (model, "computed" | "cache")

Forward = Callable[[Sequence[TokenSequence], Sequence[bool]], list[np.ndarray]]


def embed_texts(model: ServedModel, forward: Forward, texts: Sequence[str]) -> np.ndarray:
    """The model's default embed of `texts` (float32, one row each), BATCH at a time,
    each cut to MAX_TOKENS tokens: the vectors an int8/uint8 request quantizes."""
    truncate = min(MAX_TOKENS, model.info.max_input_tokens)
    rows: list[np.ndarray] = []
    for start in range(0, len(texts), BATCH):
        request = PoolRequest(
            task=Task.EMBED,
            params=PoolingParams(truncate_prompt_tokens=truncate),
            texts=tuple(texts[start : start + BATCH]),
        )
        plan = plan_request(request, model)
        raws = forward([sequence for sequence, _ in plan.work], [keep for _, keep in plan.work])
        rows.extend(output.values for output in plan.finish(raws))  # type: ignore[union-attr]
    return np.stack(rows).astype(np.float32)


def ranges_of(vectors: np.ndarray) -> list[list[float]]:
    """Per dimension: [minimums, maximums], as quantize_embeddings computes its ranges."""
    return np.vstack([vectors.min(axis=0), vectors.max(axis=0)]).astype(np.float32).tolist()


def ranges_key(model_settings: dict[str, Any], model: ServedModel, texts: Sequence[str]) -> dict:
    """The cache key's settings: the model's (select.model_key), what runs its forward and
    what shapes its default embed, and the calibration texts."""
    info = model.info
    return {
        "what": "calibration_ranges",
        "format": RANGES_FORMAT,
        **model_settings,
        "backend": info.backend,
        "precision": info.precision,
        "backend_file": info.backend_file,
        "dtype": info.dtype,
        "device": info.device.split(":")[0],
        "pooling": str(info.pooling_type),
        "normalize": info.default_normalize,
        "prompt": info.prompts.get(info.default_prompt_name or "", ""),
        "include_prompt": info.include_prompt,
        "hidden_size": info.hidden_size,
        "max_tokens": MAX_TOKENS,
        "batch": BATCH,
        "texts": hashlib.sha256("\n".join(texts).encode()).hexdigest(),
    }


def computed_ranges(
    model: ServedModel,
    forward: Forward,
    texts: Sequence[str],
    model_settings: dict[str, Any],
    cache_dir: Path | None,
) -> list[list[float]]:
    """The model's ranges over `texts`: read from the cache, else computed and cached."""
    name = model.info.name
    started = time.monotonic()
    root = cache_dir or default_cache_dir()
    key = hashed(ranges_key(model_settings, model, texts))
    # Not named after the model: the same files under another served name share the entry.
    path = root / f"ranges-{key}.json"
    try:
        root.mkdir(parents=True, exist_ok=True)
        with (root / f"{path.stem}.lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another engine process may be computing them
            cached = _read(path, model.info.hidden_size)
            if cached is not None:
                EVENTS.append((name, "cache"))
                log.info(
                    "model %s: int8/uint8 ranges read from cache %s in %.3f s",
                    name,
                    path,
                    time.monotonic() - started,
                )
                return cached
            ranges = ranges_of(embed_texts(model, forward, texts))
            _write(path, ranges, len(texts))
    except OSError as exc:  # an unwritable cache costs a computation per start, not the load
        log.warning("model %s: calibration ranges not cached at %s: %s", name, path, exc)
        ranges = ranges_of(embed_texts(model, forward, texts))
        path = Path("(not cached)")
    EVENTS.append((name, "computed"))
    log.info(
        "model %s: int8/uint8 ranges computed from %d calibration texts in %.3f s (cached at %s)",
        name,
        len(texts),
        time.monotonic() - started,
        path,
    )
    return ranges


def _read(path: Path, width: int) -> list[list[float]] | None:
    """Cached ranges, or None where there are none or they do not fit the model."""
    try:
        data = json.loads(path.read_text())
        array = np.array([data["min"], data["max"]], dtype=np.float64)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError) as exc:
        log.warning("cached calibration ranges %s unreadable (%s); computing again", path, exc)
        return None
    if array.shape != (2, width) or not np.isfinite(array).all() or (array[0] > array[1]).any():
        log.warning("cached calibration ranges %s do not fit the model; computing again", path)
        return None
    return array.astype(np.float32).tolist()


def _write(path: Path, ranges: list[list[float]], texts: int) -> None:
    partial = path.with_name(f"{path.name}.partial")
    partial.write_text(json.dumps({"min": ranges[0], "max": ranges[1], "texts": texts}))
    os.replace(partial, path)
