"""What the exported backends (ONNX Runtime, OpenVINO) share: the forward as a graph, the
model it is exported from, and the export cache.

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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

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
)
from pooling_server.engine.models.model_info import HeadKind

if TYPE_CHECKING:
    from pooling_server.engine.backends.torch_backend import TorchBackend

log = logging.getLogger(__name__)

EXPORT_FORMAT = 1  # bump when the export itself changes, to leave old cache entries behind
# Folders of a model that hold exports, not weights: not part of the model's fingerprint.
EXPORT_FOLDERS = frozenset({"onnx", "openvino", ".git", ".cache"})
EXAMPLE_TEXTS = ["a first example text", "and a second, longer example text"]

# Observable in tests: how each backend was obtained in this process.
EVENTS: list[tuple[str, str]] = []  # (model, "export" | "cache" | "file")

Inputs = Callable[[list[str]], dict[str, np.ndarray]]  # texts -> a padded batch's arrays


@dataclass
class ModelSource:
    """What a backend is made from: the loaded model on torch (the module every export
    traces, and the reference they are checked against) and how texts become its inputs."""

    name: str
    folder: Path
    head: HeadKind
    torch: TorchBackend
    dtype: torch.dtype  # as the module was loaded
    inputs: Inputs
    key_extra: dict[str, Any]  # settings beside the files that shape the graph

    @property
    def module(self) -> torch.nn.Module:
        return self.torch.module


@dataclass
class TowerSource:
    """An image model's image tower, as engine/backends/image_tower.py exports it."""

    name: str
    folder: Path
    module: torch.nn.Module  # the whole two-tower model: get_image_features
    device: torch.device
    image_size: tuple[int, int]


def output_name(head: HeadKind) -> str:
    """The graph's one output, named as transformers' model outputs name it."""
    return "last_hidden_state" if head is HeadKind.HIDDEN else "logits"


class ForwardOnly(torch.nn.Module):
    """The module's forward with plain tensors in and the one tensor the runner needs out.

    Exporters trace positional tensors; transformers' forward takes keywords and returns
    a ModelOutput, and its cache must stay off so that no key/value state is traced.
    """

    def __init__(self, module: torch.nn.Module, head: HeadKind) -> None:
        super().__init__()
        self.module = module
        self.output = output_name(head)
        if hasattr(module, "config"):
            module.config.use_cache = False

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if token_type_ids is not None:
            inputs["token_type_ids"] = token_type_ids
        return getattr(self.module(**inputs, return_dict=True), self.output)


class Exported:
    """A backend that runs an export of the module, float32 or int8, on the CPU: what each
    such backend adds (its package, file names, exporter and runtime) to the shared cache.

    Subclasses set the class facts and implement `version`, `export`, `open` and
    `open_image_tower`; the instances they open are Backends."""

    kind: ClassVar[BackendKind]
    package: ClassVar[str]  # the package it needs ("onnxruntime", "openvino")
    suffix: ClassVar[str]  # a shipped file's ending (--backend-file)
    files: ClassVar[tuple[str, str]]  # its export's file name: float32, int8
    exported = True  # checked against torch before it serves
    quantizes = True  # --quantize int8
    module = None  # no torch module: the export holds its own weights
    graphs = None
    fills_inputs = True

    @staticmethod
    def version() -> str:
        raise NotImplementedError

    @staticmethod
    def runs_here(device: torch.device, dtype: torch.dtype) -> bool:
        return device.type == "cpu" and dtype == torch.float32

    @classmethod
    def export(
        cls,
        source: ModelSource,
        example: dict[str, np.ndarray],
        options: BackendOptions,
        folder: Path,
        name: str,
    ) -> None:
        """Write the export of `source` as folder/name (int8 where options say)."""
        raise NotImplementedError

    @classmethod
    def open(cls, path: Path, head: HeadKind, threads: int, auto: bool = False) -> Backend:
        """The file ready to run; `auto`: chosen by --backend auto, which may take a
        faster precision that the parity check then holds to float32's bar."""
        raise NotImplementedError

    @classmethod
    def open_image_tower(cls, path: Path, threads: int) -> Backend:
        raise NotImplementedError

    @classmethod
    def key_settings(cls, source: ModelSource, options: BackendOptions) -> dict[str, Any]:
        """What else shapes its export beyond the model and the backend's version."""
        return {}

    @classmethod
    def image_tower(cls, tower: TowerSource, settings: RuntimeSettings | None, threads: int) -> Any:
        """The image tower's ONNX export (shared by every exported backend), opened here."""
        from pooling_server.engine.backends.image_tower import cached_export

        return cls.open_image_tower(cached_export(tower, settings), threads)

    def feed(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {name: arrays[name] for name in self.input_names}  # type: ignore[attr-defined]

    def nearer(self) -> Backend | None:
        return None

    @classmethod
    def obtain(
        cls,
        source: ModelSource,
        options: BackendOptions,
        settings: RuntimeSettings,
        threads: int,
        auto: bool,
    ) -> tuple[Backend, str]:
        """The shipped --backend-file, else the cached export, else a new export; with how
        it was obtained, for the start-up log."""
        if options.file:
            return cls._shipped(source, options, threads)
        fast = auto and options.quantize is not Quantize.INT8
        return cls._cached(source, options, settings, threads, fast)

    @classmethod
    def _shipped(
        cls, source: ModelSource, options: BackendOptions, threads: int
    ) -> tuple[Backend, str]:
        file = str(options.file)
        if not file.endswith(cls.suffix):
            raise ValueError(f"model {source.name}: --backend-file {file} is not a {cls.kind} file")
        path = source.folder / file
        if not path.is_file():
            raise ValueError(f"model {source.name}: --backend-file {file}: {path} does not exist")
        if options.quantize:
            log.warning(
                "model %s: --quantize ignored: --backend-file %s is served as it is",
                source.name,
                file,
            )
        try:
            backend = cls.open(path, source.head, threads)
        except Exception as exc:
            raise ValueError(
                f"model {source.name}: --backend {cls.kind} could not load {path}: {short(exc)}"
            ) from None
        EVENTS.append((source.name, "file"))
        return backend, "shipped file"

    @classmethod
    def cache_key(cls, source: ModelSource, options: BackendOptions) -> tuple[str, dict[str, Any]]:
        settings: dict[str, Any] = {
            "format": EXPORT_FORMAT,
            "backend": str(cls.kind),
            "backend_version": cls.version(),
            "quantize": str(options.quantize or ""),
            **model_key(source.folder, source.head, source.key_extra),
            **cls.key_settings(source, options),
        }
        return hashed(settings), settings

    @classmethod
    def _cached(
        cls,
        source: ModelSource,
        options: BackendOptions,
        settings: RuntimeSettings,
        threads: int,
        fast: bool,
    ) -> tuple[Backend, str]:
        kind = cls.kind
        key, key_settings = cls.cache_key(source, options)
        root = settings.cache_dir or default_cache_dir()
        entry = root / f"{slug(source.name)}-{kind}-{key}"
        target = entry / cls.files[options.quantize is Quantize.INT8]
        marker = entry / "export.json"
        root.mkdir(parents=True, exist_ok=True)
        with (root / f"{entry.name}.lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another engine process may be exporting it
            if marker.is_file() and target.is_file():
                started = time.monotonic()
                try:
                    backend = cls.open(target, source.head, threads, fast)
                except Exception as exc:
                    log.warning(
                        "model %s: cached export %s does not load (%s); exporting again",
                        source.name,
                        target,
                        short(exc),
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
                    return backend, "from cache"
            shutil.rmtree(entry, ignore_errors=True)
            staging = root / f".{entry.name}.partial"
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
            started = time.monotonic()
            try:
                example = source.inputs(EXAMPLE_TEXTS)
                cls.export(source, example, options, staging, target.name)
            except BackendUnavailable:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            except Exception as exc:
                shutil.rmtree(staging, ignore_errors=True)
                log.debug("export of %s to %s failed", source.name, kind, exc_info=True)
                raise BackendUnavailable(
                    f"model {source.name}: exporting to {kind} failed: {short(exc)}"
                ) from None
            seconds = time.monotonic() - started
            (staging / "export.json").write_text(
                json.dumps({**key_settings, "export_seconds": round(seconds, 2)}, indent=1)
            )
            staging.rename(entry)
            EVENTS.append((source.name, "export"))
            log.info(
                "model %s: exported to %s in %.2f s, cached at %s",
                source.name,
                kind,
                seconds,
                target,
            )
        try:
            backend = cls.open(target, source.head, threads, fast)
        except Exception as exc:
            raise BackendUnavailable(
                f"model {source.name}: {kind} could not load its export {target}: {short(exc)}"
            ) from None
        return backend, f"exported in {seconds:.1f} s"


def short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:500]


def slug(name: str) -> str:
    """A served name as part of a cache folder's name."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)[-60:]


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
