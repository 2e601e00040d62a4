"""ColBERT-style multi-vector models: a folder's query/document settings, the projected
token states, and MaxSim.

Two layouts say the same things: PyLate's (top-level query_prefix, document_prefix,
query_length, document_length, attend_to_expansion_tokens, skiplist_words and
do_query_expansion in config_sentence_transformers.json, a Dense module on token states)
and sentence-transformers 6's MultiVectorEncoder (prompts "query"/"document", the
Transformer's query_expansion and document_length in sentence_bert_config.json, a
MultiVectorMask module holding the skiplist). Both are read into one MultiVectorSettings.

Torch-free (front ends plan with it); the module that runs lives in
engine/families/colbert/multi_vector_module.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

QUERY = "query"
DOCUMENT = "document"
MODES = (QUERY, DOCUMENT)


@dataclass(frozen=True)
class MultiVectorSettings:
    """How query and document texts become token sequences (ModelInfo.settings)."""

    query_prefix: str
    document_prefix: str
    query_length: int | None  # with expansion: the exact length of every query
    document_length: int | None
    query_expansion: bool
    attend_to_expansion: bool
    expansion_truncates: bool  # "fixed" (PyLate): longer queries are cut to query_length
    mask_token_id: int
    skiplist_words: tuple[str, ...] = ()
    skiplist_ids: tuple[int, ...] = ()
    dimension: int = 0

    def kept_tokens(self, query: bool, truncate: int | None, maximum: int) -> int:
        """The most tokens a text of the mode keeps: the mode's length (a query's only a
        floor under "min" expansion), the request's truncation and the maximum length."""
        length = self.query_length if query else self.document_length
        if query and self.query_expansion and not self.expansion_truncates:
            length = None
        cut = truncate if truncate not in (None, -1) else None
        return min(n for n in (length, cut, maximum) if n is not None)


def query_mode(
    prompt_name: str | None, prompt: str | None, default_prompt_name: str | None
) -> bool:
    """Whether embed_multi runs in query mode: prompt_name "query", or with neither a name
    nor a prompt given, a model whose default prompt name is "query"."""
    named = prompt_name
    if named is None and prompt is None:
        named = default_prompt_name
    return named == QUERY


@dataclass(frozen=True)
class FolderSettings:
    """What the folder's files say, before the tokenizer resolves ids."""

    query_prefix: str
    document_prefix: str
    query_length: int | None
    document_length: int | None
    query_expansion: bool
    attend_to_expansion: bool
    expansion_truncates: bool
    skiplist_words: tuple[str, ...]
    dense: Path


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


_PYLATE_KEYS = ("query_prefix", "document_prefix", "query_length", "do_query_expansion")


def read_folder(path: Path) -> FolderSettings | None:
    """The multi-vector settings of a PyLate or MultiVectorEncoder folder; None for others."""
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    kinds = [m.get("type", "").rsplit(".", 1)[-1] for m in modules]
    st = _json(path / "config_sentence_transformers.json")
    pylate = st.get("model_type") == "ColBERT" or any(key in st for key in _PYLATE_KEYS)
    native = st.get("model_type") == "MultiVectorEncoder" or "MultiVectorMask" in kinds
    if not (pylate or native):
        return None
    dense = [
        path / m.get("path", "") for m, kind in zip(modules, kinds, strict=True) if kind == "Dense"
    ]
    others = set(kinds) - {"Transformer", "Dense", "MultiVectorMask", "Normalize"}
    if len(dense) != 1 or others:
        raise ValueError(
            f"{path}: a multi-vector folder needs the Transformer and one Dense projection "
            f"(with MultiVectorMask and Normalize optional); it lists {', '.join(kinds)}"
        )
    bert = _json(path / "sentence_bert_config.json")
    prompts = st.get("prompts") or {}
    if native and not pylate:
        expansion = bert.get("query_expansion") or None
        mask = next(
            (
                path / m.get("path", "")
                for m, k in zip(modules, kinds, strict=True)
                if k == "MultiVectorMask"
            ),
            None,
        )
        mask_config = _json(mask / "config.json") if mask is not None else {}
        if DOCUMENT not in (mask_config.get("skiplist_tasks") or [DOCUMENT]):
            raise ValueError(f"{path}: a skiplist applied to queries is not supported")
        return FolderSettings(
            query_prefix=str(prompts.get(QUERY, "")),
            document_prefix=str(prompts.get(DOCUMENT, "")),
            query_length=(expansion or {}).get("length") or bert.get("query_length"),
            document_length=bert.get("document_length"),
            query_expansion=expansion is not None,
            attend_to_expansion=bool((expansion or {}).get("attend", False)),
            expansion_truncates=(expansion or {}).get("strategy", "fixed") == "fixed",
            skiplist_words=tuple(mask_config.get("skiplist_words") or ()),
            dense=dense[0],
        )
    # PyLate: its prefix goes ahead of any saved prompt; it pads queries by default.
    skiplist = st.get("skiplist_words")
    if skiplist is None:
        import string

        skiplist = list(string.punctuation)  # PyLate's default
    return FolderSettings(
        query_prefix=str(st.get("query_prefix") or "") + str(prompts.get(QUERY, "")),
        document_prefix=str(st.get("document_prefix") or "") + str(prompts.get(DOCUMENT, "")),
        query_length=st.get("query_length") or 32,
        document_length=st.get("document_length") or bert.get("max_seq_length"),
        query_expansion=st.get("do_query_expansion", True) is not False,
        attend_to_expansion=bool(st.get("attend_to_expansion_tokens", False)),
        expansion_truncates=True,
        skiplist_words=tuple(str(w) for w in skiplist),
        dense=dense[0],
    )


def resolve(folder: FolderSettings, tokenizer: Any, dimension: int) -> MultiVectorSettings:
    """Token ids of the expansion token and the skiplist words (each a single token in the
    vocabulary; others are left out, as sentence-transformers leaves out words it maps to
    [UNK])."""
    mask_id = tokenizer.mask_token_id
    if folder.query_expansion and mask_id is None:
        raise ValueError("query expansion needs a mask token, and the tokenizer has none")
    ids: list[int] = []
    for word in folder.skiplist_words:
        pieces = tokenizer.encode(word, add_special_tokens=False)
        if len(pieces) == 1 and pieces[0] != tokenizer.unk_token_id:
            ids.append(int(pieces[0]))
    return MultiVectorSettings(
        query_prefix=folder.query_prefix,
        document_prefix=folder.document_prefix,
        query_length=int(folder.query_length) if folder.query_length else None,
        document_length=int(folder.document_length) if folder.document_length else None,
        query_expansion=folder.query_expansion,
        attend_to_expansion=folder.attend_to_expansion,
        expansion_truncates=folder.expansion_truncates,
        mask_token_id=int(mask_id) if mask_id is not None else -1,
        skiplist_words=folder.skiplist_words,
        skiplist_ids=tuple(sorted(set(ids))),
        dimension=dimension,
    )


def maxsim(query: np.ndarray, document: np.ndarray) -> float:
    """Sum over query rows of the best dot product with a document row (rows normalised,
    so the cosine), in float32; an empty document scores 0."""
    if len(document) == 0 or len(query) == 0:
        return 0.0
    return float((query.astype(np.float32) @ document.astype(np.float32).T).max(axis=1).sum())
