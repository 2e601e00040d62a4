"""Choosing a model's backend: a lookup in the registry, and one parity check.

--backend names one backend; `auto` tries the fastest that runs here (exports run float32
on the CPU) and passes the check, torch last. A family whose module no export can follow
runs on the backends it lists (torch alone, for the LLM reranker, ColBERT and bge-m3).
Every export is checked against torch on a few texts before it serves.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from pooling_server.engine.backends import (
    Backend,
    BackendKind,
    BackendOptions,
    BackendUnavailable,
    RuntimeSettings,
    read_calibration,
)
from pooling_server.engine.backends.export import (  # noqa: F401 (the cache's names, here too)
    EVENTS,
    EXPORT_FORMAT,
    ModelSource,
    hashed,
    model_key,
    short,
)
from pooling_server.engine.backends.registry import (
    AUTO_ORDER,
    EVERY,
    FP32_MIN_COSINE,
    REGISTRY,
    backend_class,
    kind_of_file,
)

log = logging.getLogger(__name__)

# On token states (what the check compares) int8 strays more than on pooled vectors,
# where MiniLM keeps a mean of 0.99 (tests/engine/backends/test_backends.py).
INT8_MEAN_COSINE = 0.98
CHECK_TEXTS = 8
FLAG_HINT = "choose another with --backend (torch always works)"
INSTALL_HINT = "; install it (make venv installs it)"


@dataclass(frozen=True)
class Chosen:
    """The backend a model runs on."""

    backend: Backend
    kind: BackendKind
    precision: str
    file: str  # "" for torch
    how: str  # for the start-up log


def choose_backend(
    source: ModelSource,
    options: BackendOptions,
    settings: RuntimeSettings,
    device: torch.device,
    dtype: torch.dtype,
    threads: int,
    runs_on: tuple[BackendKind, ...] = EVERY,
    title: str = "",
) -> Chosen:
    """The backend asked for, or with `auto` the first of AUTO_ORDER that runs here, loads
    and matches torch (logging why each before it was skipped); raises ValueError naming the
    flag. `runs_on`: the backends the model's family runs on; `title`: how messages (and
    the start-up log, for the reason of its backend) name such a model ("a multi-vector
    model")."""
    name = source.name
    kind = options.kind
    auto = kind is BackendKind.AUTO
    _check_family(options, runs_on, title, name)
    if options.file:
        kind = _file_kind(options.file, kind, name)
    kinds = tuple(k for k in AUTO_ORDER if k in runs_on and REGISTRY[k].runs_here(device, dtype))
    kinds = kinds if kind is BackendKind.AUTO else (kind,)
    where = f"{str(dtype).removeprefix('torch.')} on {device}"
    if not REGISTRY[kinds[0]].runs_here(device, dtype):
        raise ValueError(
            f"model {name}: --backend {kind} runs float32 on the CPU, not {where}; pass "
            "--device cpu (and --dtype float32 or auto) or --backend torch"
        )
    if options.quantize and not REGISTRY[kinds[0]].quantizes:
        if not auto:
            raise ValueError(
                f"model {name}: --quantize int8 runs on --backend onnx or openvino, not torch"
            )
        log.warning(
            "model %s: --quantize int8 ignored: on %s/%s --backend auto runs torch",
            name,
            device,
            str(dtype).removeprefix("torch."),
        )
    check = [*read_calibration(None, "")[:CHECK_TEXTS], "ok"]
    reference: np.ndarray | None = None
    reasons: list[str] = []
    for candidate in kinds:
        try:
            backend_type = backend_class(candidate, name, INSTALL_HINT)
            if backend_type.exported and reference is None:  # before any tracing touches it
                reference = source.torch.reference(source.inputs(check))
            backend, how = backend_type.obtain(source, options, settings, threads, auto)
            if backend_type.exported:
                backend = _checked(source, backend, check, reference, strict=auto)
        except BackendUnavailable as exc:
            if not auto:
                raise ValueError(f"{exc}; {FLAG_HINT}") from None
            reasons.append(str(exc))
            log.warning("model %s: --backend auto skips %s: %s", name, candidate, exc)
            continue
        if reasons:
            log.warning(
                "model %s: --backend auto falls back to torch (%s)", name, "; ".join(reasons)
            )
            how = "torch (auto fallback)"
        file = str(backend.file) if backend.file is not None else ""
        return Chosen(backend, candidate, backend.precision, file, title or how)
    raise AssertionError("torch, last in AUTO_ORDER, serves every model")


def _file_kind(file: str, kind: BackendKind, model: str) -> BackendKind:
    """--backend-file's backend: its ending's, which an explicit --backend must match."""
    found = kind_of_file(file, model)
    if kind not in (BackendKind.AUTO, found):
        raise ValueError(f"model {model}: --backend-file {file} is not a {kind} file")
    return found


def _check_family(
    options: BackendOptions, runs_on: tuple[BackendKind, ...], title: str, model: str
) -> None:
    """A model whose family runs on some backends only refuses the others by name, and
    --quantize where none of its backends quantizes."""
    if runs_on == EVERY:
        return
    only = " or ".join(runs_on)
    if (options.kind is not BackendKind.AUTO and options.kind not in runs_on) or options.file:
        raise ValueError(
            f"model {model}: {title} runs on --backend {only} only, not {options.kind}"
            f"{' with --backend-file' if options.file else ''}"
        )
    if options.quantize and not any(REGISTRY[kind].quantizes for kind in runs_on):
        raise ValueError(f"model {model}: --quantize does not apply to {title}")


def _checked(
    source: ModelSource,
    backend: Backend,
    texts: list[str],
    reference: np.ndarray | None,
    strict: bool,
) -> Backend:
    """The backend if it matches torch on the check texts; else (OpenVINO's bfloat16
    under `auto`) the same file nearer torch's precision, which must match.

    On an AVX-512 BF16 host, MiniLM at batch 32 ran 2.05x OpenVINO's float32 pass (777
    against 378 texts/s) with its lowest cosine to torch 0.99998 (benchmarks/results/
    cpu-2core-openvino-bf16.txt); `auto` is the fastest backend within the check, so it
    takes bfloat16 where the check holds, and --backend openvino stays float32. OpenVINO
    itself defaults to bf16 on such CPUs, so sentence-transformers' backend="openvino" gives
    the same. bfloat16 is compiled first: a start compiles float32 only when it is needed."""
    assert reference is not None
    try:
        _report_parity(source, backend, texts, reference, strict)
        return backend
    except BackendUnavailable as exc:
        nearer = backend.nearer()
        if nearer is None:
            raise
        log.info("model %s: --backend auto keeps %s: %s", source.name, nearer.precision, exc)
    _report_parity(source, nearer, texts, reference, strict)
    return nearer


def cosines(output: np.ndarray, reference: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Per text: the cosine of its real tokens' rows (or its logits) to torch's, flattened."""
    values = []
    for i in range(reference.shape[0]):
        a = output[i][mask[i].astype(bool)] if reference.ndim == 3 else output[i]
        b = reference[i][mask[i].astype(bool)] if reference.ndim == 3 else reference[i]
        a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
        if a.size == 1:  # one logit: agreement within a relative 1e-4 counts as cosine 1
            values.append(1.0 - min(1.0, abs(a[0] - b[0]) / max(1e-6, abs(b[0]))))
            continue
        norms = np.linalg.norm(a) * np.linalg.norm(b)
        values.append(float(a @ b / norms) if norms else float(np.allclose(a, b)))
    return np.array(values)


def _report_parity(
    source: ModelSource, backend: Backend, texts: list[str], reference: np.ndarray, strict: bool
) -> None:
    """Compare with torch on a few texts; with `auto` a mismatch rules the backend out."""
    inputs = source.inputs(texts)
    zeros = np.zeros_like(inputs["input_ids"])  # token types the tokenizer did not make
    arrays = {name: inputs.get(name, zeros) for name in backend.input_names}
    try:
        output = backend.run(backend.feed(arrays))
        values = cosines(output, reference, inputs["attention_mask"])
    except Exception as exc:
        raise BackendUnavailable(
            f"model {source.name}: {backend.kind} fails on the check texts: {short(exc)}"
        ) from None
    low, mean = float(values.min()), float(values.mean())
    ok = mean >= INT8_MEAN_COSINE if backend.precision == "int8" else low >= FP32_MIN_COSINE
    log.info(
        "model %s: %s %s against torch float32 on %d check texts: lowest cosine %.6f, mean %.6f",
        source.name,
        backend.kind,
        backend.precision,
        len(texts),
        low,
        mean,
    )
    if not ok:
        message = (
            f"model {source.name}: {backend.kind} {backend.precision} strays from torch "
            f"(lowest cosine {low:.6f}, mean {mean:.6f})"
        )
        if strict:
            raise BackendUnavailable(message)
        log.warning("%s", message)
