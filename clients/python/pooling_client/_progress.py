"""The optional progress bar behind ``use_tqdm`` (tqdm is an optional extra).

``use_tqdm=True`` shows a tqdm bar counting inputs when tqdm is importable and quietly runs
without one when it is not; a callable is used as the bar factory instead of tqdm, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import Any

UseTqdm = bool | Callable[..., Any]

_DESCRIPTIONS = {
    "embed": "Embedding",
    "classify": "Classifying",
    "score": "Scoring",
    "token_embed": "Encoding",
    "token_classify": "Encoding",
    "embed_sparse": "Embedding",
}


class Progress:
    """A bar counting inputs, or nothing; use as a context manager so it always closes."""

    def __init__(self, bar: Any = None) -> None:
        self._bar = bar

    def update(self, count: int) -> None:
        if self._bar is not None and count:
            self._bar.update(count)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _tqdm_factory() -> Callable[..., Any] | None:
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm


def progress(use_tqdm: UseTqdm, total: int, task: str) -> Progress:
    """A progress bar over ``total`` inputs of ``task`` if ``use_tqdm`` asks for one."""
    if not use_tqdm:
        return Progress()
    factory = use_tqdm if callable(use_tqdm) else _tqdm_factory()
    if factory is None:
        return Progress()
    description = _DESCRIPTIONS.get(task, "Processing")
    return Progress(factory(total=total, desc=description, unit="input", dynamic_ncols=True))
