"""Choosing, exporting, caching and loading a model's backend.

An export is cached under --backend-cache-dir, keyed by a hash of the model folder's files,
the backend's and exporters' versions and the settings that shape the graph, so a changed
model (or upgraded package) re-exports and a second start loads the cached file. A lock
file lets data-parallel engine processes share one export.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pooling_server.engine.backends import (
    Backend,
    BackendKind,
    BackendOptions,
    BackendUnavailable,
    Quantize,
    RuntimeSettings,
    default_cache_dir,
    read_calibration,
)
from pooling_server.engine.models.model_info import HeadKind

log = logging.getLogger(__name__)

EXPORT_FORMAT = 1  # bump when the export itself changes, to leave old cache entries behind
FP32_MIN_COSINE = 0.9999  # every check text, against torch fp32
# On token states (what the check compares) int8 strays more than on pooled vectors,
# where MiniLM keeps a mean of 0.99 (tests/engine/test_backends.py).
INT8_MEAN_COSINE = 0.98
CHECK_TEXTS = 8
# Folders of a model that hold exports, not weights: not part of the model's fingerprint.
EXPORT_FOLDERS = frozenset({"onnx", "openvino", ".git", ".cache"})
PACKAGES = {BackendKind.ONNX: "onnxruntime", BackendKind.OPENVINO: "openvino"}
FLAG_HINT = "choose another with --backend (torch always works)"

# Observable in tests: how each backend was obtained in this process.
EVENTS: list[tuple[str, str]] = []  # (model, "export" | "cache" | "file")


@dataclass(frozen=True)
class Chosen:
    """The backend a model runs on; `backend` None means torch."""

    backend: Backend | None
    kind: BackendKind
    precision: str
    file: str  # "" for torch
    how: str  # for the start-up log


Inputs = Callable[[list[str]], dict[str, np.ndarray]]  # texts -> a padded batch's arrays
Reference = Callable[[dict[str, np.ndarray]], np.ndarray]  # the torch forward's output


@dataclass
class ModelSource:
    """What the chooser needs of a loaded model; `module` is the fp32 torch module."""

    name: str
    folder: Path
    head: HeadKind
    module: torch.nn.Module
    inputs: Inputs
    reference: Reference
    key_extra: dict[str, Any]  # settings beside the files that shape the graph


def choose_backend(
    source: ModelSource,
    options: BackendOptions,
    settings: RuntimeSettings,
    device: torch.device,
    dtype: torch.dtype,
    threads: int,
) -> Chosen:
    """The backend asked for, or with `auto` the first of OpenVINO, ONNX Runtime that loads
    and matches torch (else torch, logging why); raises ValueError naming the flag."""
    kind = options.kind
    if options.file and kind is BackendKind.AUTO:
        kind = _kind_of_file(options.file, source.name)
    torch_only = device.type != "cpu" or dtype != torch.float32
    if kind is BackendKind.TORCH or (kind is BackendKind.AUTO and torch_only):
        if options.quantize and kind is BackendKind.TORCH:
            raise ValueError(
                f"model {source.name}: --quantize int8 runs on --backend onnx or openvino, "
                "not torch"
            )
        if options.quantize:
            log.warning(
                "model %s: --quantize int8 ignored: on %s/%s --backend auto runs torch",
                source.name,
                device,
                str(dtype).removeprefix("torch."),
            )
        return Chosen(None, BackendKind.TORCH, _precision(dtype), "", "torch")
    if torch_only:
        raise ValueError(
            f"model {source.name}: --backend {kind} runs float32 on the CPU, not "
            f"{str(dtype).removeprefix('torch.')} on {device}; pass --device cpu (and "
            "--dtype float32 or auto) or --backend torch"
        )
    check = _check_texts(options)
    reference = source.reference(source.inputs(check))  # before any tracing touches it
    if kind is not BackendKind.AUTO:
        try:
            chosen = _load(kind, source, options, settings, threads)
        except BackendUnavailable as exc:
            raise ValueError(f"{exc}; {FLAG_HINT}") from None
        _report_parity(source, chosen, check, reference, strict=False)
        return chosen
    reasons = []
    for candidate in (BackendKind.OPENVINO, BackendKind.ONNX):
        try:
            chosen = _load(candidate, source, options, settings, threads, bf16_if_native=True)
            if chosen.precision == "bfloat16":
                return _bf16_else_float32(source, chosen, check, reference)
            _report_parity(source, chosen, check, reference, strict=True)
            return chosen
        except BackendUnavailable as exc:
            reasons.append(str(exc))
            log.warning("model %s: --backend auto skips %s: %s", source.name, candidate, exc)
    log.warning(
        "model %s: --backend auto falls back to torch (%s)", source.name, "; ".join(reasons)
    )
    return Chosen(None, BackendKind.TORCH, "float32", "", "torch (auto fallback)")


def _bf16_else_float32(
    source: ModelSource, chosen: Chosen, texts: list[str], reference: np.ndarray
) -> Chosen:
    """OpenVINO's export inferring in bfloat16 if its outputs pass the float32 check; else
    the same file compiled in float32, which must pass it.

    On an AVX-512 BF16 host, MiniLM at batch 32 ran 2.05x OpenVINO's float32 pass (777
    against 378 texts/s) with its lowest cosine to torch 0.99998 (benchmarks/results/
    cpu-2core-openvino-bf16.txt); `auto` is the fastest backend within the check, so it
    takes bfloat16 where the check holds, and --backend openvino stays float32. OpenVINO
    itself defaults to bf16 on such CPUs, so sentence-transformers' backend="openvino" gives
    the same. bfloat16 is compiled first: a start compiles float32 only when it is needed."""
    try:
        _report_parity(source, chosen, texts, reference, strict=True)
        return chosen
    except BackendUnavailable as exc:
        log.info("model %s: --backend auto keeps float32: %s", source.name, exc)
    backend = chosen.backend.in_float32()  # type: ignore[union-attr]
    fallback = replace(chosen, backend=backend, precision=backend.precision)
    _report_parity(source, fallback, texts, reference, strict=True)
    return fallback


def _precision(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _kind_of_file(file: str, model: str) -> BackendKind:
    if file.endswith(".onnx"):
        return BackendKind.ONNX
    if file.endswith(".xml"):
        return BackendKind.OPENVINO
    raise ValueError(
        f"model {model}: --backend-file {file} is neither an ONNX file (.onnx) nor an "
        "OpenVINO model (.xml)"
    )


def _check_texts(options: BackendOptions) -> list[str]:
    texts = read_calibration(None, "")[:CHECK_TEXTS]
    return [*texts, "ok"]


def _import(kind: BackendKind, model: str) -> Any:
    """The backend's module; a missing package is a clear load error."""
    try:
        if kind is BackendKind.ONNX:
            from pooling_server.engine.backends import onnx_backend

            onnx_backend.version()
            return onnx_backend
        from pooling_server.engine.backends import openvino_backend

        openvino_backend.version()
        return openvino_backend
    except ImportError as exc:
        raise BackendUnavailable(
            f"model {model}: --backend {kind} needs the {PACKAGES[kind]} package, which "
            f"does not import here ({exc}); install it (make venv installs it)"
        ) from None


def _load(
    kind: BackendKind,
    source: ModelSource,
    options: BackendOptions,
    settings: RuntimeSettings,
    threads: int,
    bf16_if_native: bool = False,
) -> Chosen:
    """`bf16_if_native` (auto): an OpenVINO export that is not int8 infers in bfloat16 where
    the CPU computes it itself."""
    impl = _import(kind, source.name)
    backend_class = impl.OnnxBackend if kind is BackendKind.ONNX else impl.OpenVinoBackend
    if (
        bf16_if_native
        and kind is BackendKind.OPENVINO
        and options.quantize is not Quantize.INT8
        and not options.file
        and impl.bf16_native()
    ):
        backend_class = partial(backend_class, bf16=True)
    if options.file:
        if _kind_of_file(options.file, source.name) is not kind:
            raise ValueError(
                f"model {source.name}: --backend-file {options.file} is not a {kind} file"
            )
        path = source.folder / options.file
        if not path.is_file():
            raise ValueError(
                f"model {source.name}: --backend-file {options.file}: {path} does not exist"
            )
        if options.quantize:
            log.warning(
                "model %s: --quantize ignored: --backend-file %s is served as it is",
                source.name,
                options.file,
            )
        try:
            backend = backend_class(path, source.head, threads)
        except Exception as exc:
            raise ValueError(
                f"model {source.name}: --backend {kind} could not load {path}: {_short(exc)}"
            ) from None
        EVENTS.append((source.name, "file"))
        return Chosen(backend, kind, backend.precision, str(path), "shipped file")
    return _load_cached(kind, impl, backend_class, source, options, settings, threads)


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:500]


def fingerprint(folder: Path) -> str:
    """A hash of every file of the model folder (exports aside), contents included."""
    digest = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder)
        if relative.parts[0] in EXPORT_FOLDERS or not path.is_file():
            continue
        digest.update(str(relative).encode() + b"\0")
        with path.open("rb") as handle:
            while chunk := handle.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def model_key(folder: Path, head: HeadKind, key_extra: dict[str, Any]) -> dict[str, Any]:
    """What a cache entry derived from a loaded model is keyed by, whatever it holds (an
    export, computed calibration ranges): the folder's files, the head, the torch and
    transformers versions and the settings beside the files that shape the forward."""
    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "head": str(head),
        "files": fingerprint(folder),
        **key_extra,
    }


def hashed(settings: dict[str, Any]) -> str:
    """The cache key of `settings` (JSON, keys sorted)."""
    blob = json.dumps(settings, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:24]


def cache_key(
    kind: BackendKind, impl: Any, source: ModelSource, options: BackendOptions
) -> tuple[str, dict[str, Any]]:
    settings: dict[str, Any] = {
        "format": EXPORT_FORMAT,
        "backend": str(kind),
        "backend_version": impl.version(),
        "quantize": str(options.quantize or ""),
        **model_key(source.folder, source.head, source.key_extra),
    }
    if options.quantize and kind is BackendKind.OPENVINO:
        import nncf

        texts = read_calibration(options.calibration_file, source.name)
        settings["nncf"] = nncf.__version__
        settings["calibration"] = hashlib.sha256("\n".join(texts).encode()).hexdigest()
    return hashed(settings), settings


def _file_name(kind: BackendKind, quantized: bool) -> str:
    if kind is BackendKind.ONNX:
        return "model_qint8.onnx" if quantized else "model.onnx"
    return "openvino_model_qint8.xml" if quantized else "openvino_model.xml"


def _load_cached(
    kind: BackendKind,
    impl: Any,
    backend_class: Any,
    source: ModelSource,
    options: BackendOptions,
    settings: RuntimeSettings,
    threads: int,
) -> Chosen:
    key, key_settings = cache_key(kind, impl, source, options)
    root = settings.cache_dir or default_cache_dir()
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", source.name)[-60:]
    entry = root / f"{slug}-{kind}-{key}"
    target = entry / _file_name(kind, options.quantize is Quantize.INT8)
    marker = entry / "export.json"
    root.mkdir(parents=True, exist_ok=True)
    with (root / f"{entry.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another engine process may be exporting it
        if marker.is_file() and target.is_file():
            started = time.monotonic()
            try:
                backend = backend_class(target, source.head, threads)
            except Exception as exc:
                log.warning(
                    "model %s: cached export %s does not load (%s); exporting again",
                    source.name,
                    target,
                    _short(exc),
                )
            else:
                EVENTS.append((source.name, "cache"))
                log.info(
                    "model %s: %s loaded from cache %s in %.2f s (no export)",
                    source.name,
                    kind,
                    target,
                    time.monotonic() - started,
                )
                return Chosen(backend, kind, backend.precision, str(target), "from cache")
        shutil.rmtree(entry, ignore_errors=True)
        staging = root / f".{entry.name}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        started = time.monotonic()
        try:
            _export(kind, impl, source, options, staging, target.name)
        except BackendUnavailable:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        except Exception as exc:
            shutil.rmtree(staging, ignore_errors=True)
            log.debug("export of %s to %s failed", source.name, kind, exc_info=True)
            raise BackendUnavailable(
                f"model {source.name}: exporting to {kind} failed: {_short(exc)}"
            ) from None
        seconds = time.monotonic() - started
        (staging / "export.json").write_text(
            json.dumps({**key_settings, "export_seconds": round(seconds, 2)}, indent=1)
        )
        staging.rename(entry)
        EVENTS.append((source.name, "export"))
        log.info(
            "model %s: exported to %s in %.2f s, cached at %s", source.name, kind, seconds, target
        )
    try:
        backend = backend_class(target, source.head, threads)
    except Exception as exc:
        raise BackendUnavailable(
            f"model {source.name}: {kind} could not load its export {target}: {_short(exc)}"
        ) from None
    return Chosen(backend, kind, backend.precision, str(target), f"exported in {seconds:.1f} s")


def _export(
    kind: BackendKind,
    impl: Any,
    source: ModelSource,
    options: BackendOptions,
    folder: Path,
    name: str,
) -> None:
    example = source.inputs(["a first example text", "and a second, longer example text"])
    quantized = options.quantize is Quantize.INT8
    if kind is BackendKind.ONNX:
        fp32 = folder / "model.onnx"
        impl.export(source.module, source.head, example, fp32)
        if quantized:
            impl.quantize(fp32, folder / name)
        return
    model = impl.convert(source.module, source.head, example)
    if quantized:
        try:
            import nncf  # noqa: F401
        except ImportError as exc:
            raise BackendUnavailable(
                f"model {source.name}: --quantize int8 on openvino needs the nncf package, "
                f"which does not import here ({exc}); install it, or use --backend onnx"
            ) from None
        texts = read_calibration(options.calibration_file, source.name)
        model = impl.quantize(model, [source.inputs([text]) for text in texts])
    impl.save(model, folder / name)


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
    source: ModelSource, chosen: Chosen, texts: list[str], reference: np.ndarray, strict: bool
) -> None:
    """Compare with torch on a few texts; with `auto` a mismatch rules the backend out."""
    assert chosen.backend is not None
    inputs = source.inputs(texts)
    feed = {
        name: inputs.get(name, np.zeros_like(inputs["input_ids"]))
        for name in chosen.backend.input_names
    }
    try:
        output = chosen.backend.run(feed)
        values = cosines(output, reference, inputs["attention_mask"])
    except Exception as exc:
        raise BackendUnavailable(
            f"model {source.name}: {chosen.kind} fails on the check texts: {_short(exc)}"
        ) from None
    low, mean = float(values.min()), float(values.mean())
    ok = mean >= INT8_MEAN_COSINE if chosen.precision == "int8" else low >= FP32_MIN_COSINE
    log.info(
        "model %s: %s %s against torch float32 on %d check texts: lowest cosine %.6f, mean %.6f",
        source.name,
        chosen.kind,
        chosen.precision,
        len(texts),
        low,
        mean,
    )
    if not ok:
        message = (
            f"model {source.name}: {chosen.kind} {chosen.precision} strays from torch "
            f"(lowest cosine {low:.6f}, mean {mean:.6f})"
        )
        if strict:
            raise BackendUnavailable(message)
        log.warning("%s", message)
