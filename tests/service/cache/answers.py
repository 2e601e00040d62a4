"""What the cache's server tests compare: an answer's outputs, floats within a rounding."""

from __future__ import annotations

import math
from typing import Any

from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message


def outputs(response: Message) -> dict[str, Any]:
    """The answer without its request id and usage."""
    found = MessageToDict(response)
    found.pop("requestId", None)
    found.pop("usage", None)
    return found


def assert_same(got: Any, want: Any, path: str = "") -> None:
    """Equal, floats to 1e-5 (a pass in another batch may round otherwise)."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), path
        for key in want:
            assert_same(got[key], want[key], f"{path}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), path
        for n, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{path}[{n}]")
    elif isinstance(want, float):
        assert math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-6), (path, got, want)
    else:
        assert got == want, (path, got, want)
