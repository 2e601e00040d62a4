"""Embed calls made from several threads beside a server's restart, drain or scale-out,
counted: those answered whole, and each failure by name."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from pooling_client import PoolingClient
from pooling_client.errors import PoolingError

WIDTH = 384  # all-MiniLM-L6-v2's, the model these loads call


@dataclass(kw_only=True)
class EmbedTally:
    ok: int = 0
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def embed(self, client: PoolingClient, text: str, **call: Any) -> None:
        """One embed of `text` (which names the call in an error), counted."""
        try:
            [output] = client.embed([text], **call)
            assert len(output.outputs.embedding) == WIDTH
            with self.lock:
                self.ok += 1
        except PoolingError as error:
            with self.lock:
                self.errors.append(f"{text}: {error}")
