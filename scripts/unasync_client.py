"""Generate the blocking client (client.py) from the asyncio one (async_client.py).

The two clients are one implementation: async_client.py is written by hand, and this
script derives client.py from it by rewriting the async syntax away and pointing it at
_io_sync instead of _io_async (the only modules where the two kinds of I/O differ), as
httpx does with unasync. `--check` fails if the committed client.py differs, which the
client tests also check.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "clients" / "python" / "pooling_client"
SOURCE = PACKAGE / "async_client.py"
TARGET = PACKAGE / "client.py"

DOCSTRING = '''"""PoolingClient: a blocking client whose methods mirror vLLM's ``LLM`` pooling API.

``client.embed(texts)`` returns what ``LLM.embed(texts)`` would, but runs on a remote pooling
server, so scripts written against vLLM port over by swapping the object they call.

Generated from async_client.py by scripts/unasync_client.py: edit that file, then run
`make clients`.
"""'''

# (pattern, replacement), applied in order to everything after the module docstring.
RULES: list[tuple[str, str]] = [
    (r"\bAsyncPoolingClient\b", "PoolingClient"),
    (r"\b_io_async\b", "_io_sync"),
    (r"\basync def __aenter__\b", "def __enter__"),
    (r"\basync def __aexit__\b", "def __exit__"),
    (r"\basync (def|with|for) ", r"\1 "),
    (r"\bawait ", ""),
    (r"\(async vLLM ", "(vLLM "),
    (
        r"Asyncio client for a pooling server; create it inside the event loop that uses it\.",
        "Blocking client for a pooling server.",
    ),
]


def generate() -> str:
    source = SOURCE.read_text()
    end = source.index('"""', 3) + 3  # the module docstring
    body = source[end:]
    for pattern, replacement in RULES:
        body = re.sub(pattern, replacement, body)
    formatted = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--stdin-filename", str(TARGET), "-"],
        input=DOCSTRING + body,
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    return formatted.stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if client.py is stale")
    args = parser.parse_args(argv)
    generated = generate()
    if args.check:
        if TARGET.read_text() != generated:
            print(f"{TARGET} is stale: run `make clients`", file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(generated)
    return 0


if __name__ == "__main__":
    sys.exit(main())
