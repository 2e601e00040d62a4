"""What a cached output is keyed on (docs/cache.md names every field).

A key joins three parts, each hashed where it is known:

- the model's identity (`model_identity`, once per loaded model, in the process that holds
  its weights): its served name, a digest of its folder's files (weights, config,
  tokenizer: a new revision misses), the backend, dtype and precision (quantization), and
  the settings its family read at load (pooling, score template, projection);
- the request's tag (`request_tag`, once per request, in the front end): the task, the
  adapter, the prompt (a prompt name resolved to its text, or a reranker's instruction),
  truncation and the long-input policy, the token budget, late chunking's rule, the
  outputs asked of a multi-output model, and the scope (an API key's digest);
- the item (`item_key`): the exact sequence the model computes, its token ids and token
  types, or an image's or audio clip's decoded samples, and what the forward returns for
  it (its pooled vector, every token's row, or late chunking's ranges).

What applies after the forward (dimensions, normalisation, activation, encodings, sparse
top-k) is left out, so those variants share one entry.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np

KEY_VERSION = b"pooling-cache-v1\0"
KEY_BYTES = 20

_IDS = np.dtype("<i4")
_PIXELS = np.dtype("<f4")


def _field(hasher: Any, value: object) -> None:
    """One field, length-prefixed so that no two field lists hash alike."""
    data = value if isinstance(value, bytes) else repr(value).encode()
    hasher.update(len(data).to_bytes(8, "little"))
    hasher.update(data)


# A folder's digest per (path, each file's size and mtime): computed once a process and
# revision, since hashing a model's weights reads every byte of them.
_FOLDER_DIGESTS: dict[tuple[object, ...], bytes] = {}
_FOLDER_LOCK = threading.Lock()


def _folder_files(folder: Path) -> list[Path]:
    """Every file of a model folder (weights, config, tokenizer, modules), sorted; hidden
    folders (.git, .cache) left out."""
    found = []
    for root, dirs, files in os.walk(folder, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [Path(root, name) for name in files if not name.startswith(".")]
    return sorted(found)


def folder_digest(folder: str | os.PathLike[str]) -> bytes:
    """A digest of every file's path and bytes in a model folder, hashed once per revision
    (the same files, sizes and mtimes reuse the digest)."""
    path = Path(folder)
    files = _folder_files(path)
    stats = tuple((str(f.relative_to(path)), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    memo = (str(path.resolve()), stats)
    with _FOLDER_LOCK:
        known = _FOLDER_DIGESTS.get(memo)
        if known is not None:
            return known
        hasher = hashlib.blake2b(digest_size=KEY_BYTES)
        for file, (name, size, _) in zip(files, stats, strict=True):
            _field(hasher, name)
            _field(hasher, size)
            with file.open("rb") as handle:
                while block := handle.read(1 << 20):
                    hasher.update(block)
        digest = _FOLDER_DIGESTS[memo] = hasher.digest()
        return digest


def model_identity(info: Any, folder: str | os.PathLike[str] | None) -> bytes:
    """The model part of every key: name, folder digest (the revision where no folder is
    known), backend, dtype, precision and the settings read at load."""
    hasher = hashlib.blake2b(KEY_VERSION, digest_size=KEY_BYTES)
    _field(hasher, info.name)
    _field(hasher, folder_digest(folder) if folder is not None else info.revision)
    for value in (
        info.family,
        info.architecture,
        info.backend,
        info.backend_file,
        info.precision,
        info.dtype,
        str(info.pooling_type),
        info.projected,
        info.max_input_tokens,
        info.include_prompt,
        repr(info.settings),  # a two-tower model's towers among them
    ):
        _field(hasher, value)
    return hasher.digest()


def scope_of(api_key: str | None) -> str:
    """An API key's scope tag: a digest, never the key itself (it travels to engines)."""
    if not api_key:
        return ""
    return hashlib.blake2b(api_key.encode(), digest_size=12, person=b"cache-scope").hexdigest()


def request_tag(resolved: Any, scope: str = "") -> bytes:
    """The request part of every key of its items (computed once per request)."""
    request = resolved.request
    chunking = request.late_chunking
    hasher = hashlib.blake2b(KEY_VERSION, digest_size=KEY_BYTES)
    for value in (
        str(request.task),
        getattr(request, "adapter", None),
        resolved.prompt,
        resolved.truncate,
        resolved.side,
        str(resolved.long_input),
        request.params.truncate_prompt_tokens,
        request.max_tokens,
        None
        if chunking is None
        else (chunking.spans, str(chunking.rule), chunking.window, chunking.overlap),
        sorted(map(str, request.outputs)),
        scope,
    ):
        _field(hasher, value)
    return hasher.digest()


def item_key(model: bytes, tag: bytes, sequence: Any, keep: object) -> bytes:
    """One item's key: model identity, request tag, what the forward returns for it
    (`keep`), then its content: token ids and types, or a frame's samples and shape."""
    hasher = hashlib.blake2b(model, digest_size=KEY_BYTES)
    hasher.update(tag)
    _field(hasher, keep)
    pixels = getattr(sequence, "pixels", None)
    if pixels is not None:  # an image or audio clip, decoded (engine/inputs/modality.py)
        samples = np.ascontiguousarray(pixels, dtype=_PIXELS)
        _field(hasher, (sequence.patches, samples.shape))
        hasher.update(memoryview(samples).cast("B"))
        return hasher.digest()
    ids = np.asarray(sequence.input_ids, dtype=_IDS)
    _field(hasher, len(ids))
    hasher.update(ids.tobytes())
    types = sequence.token_type_ids
    if types is not None:
        hasher.update(b"T")
        hasher.update(np.asarray(types, dtype=_IDS).tobytes())
    return hasher.digest()
