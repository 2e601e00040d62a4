"""service/ops/memory.py: a process with the front end's malloc settings hands a freed large
block back to the kernel, where glibc's defaults keep it (in a child process each, so this
process keeps its own settings). The floods in tests/reliability measure the whole effect."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Allocate and free 16 MB messages the way a flood does, after a larger block was freed
# (which raises glibc's default mmap threshold past them), with a small block that stays
# allocated after each round (as the server's other allocations do); print RSS growth in MB.
PROBE = """
import ctypes, sys
from pooling_server.service.ops.memory import return_freed_memory
if sys.argv[1] == "settings":
    assert return_freed_memory()
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
big = libc.malloc(20 << 20); ctypes.memset(big, 1, 20 << 20); libc.free(big)
before = rss()
pins = []
for _ in range(8):
    blocks = [libc.malloc(16 << 20) for _ in range(3)]
    pins.append(libc.malloc(1 << 20))  # a live block above them: the heap top cannot be trimmed
    for block in blocks:
        ctypes.memset(block, 1, 16 << 20)
    for block in blocks:
        libc.free(block)
print((rss() - before) / 2**20)
"""


def _growth(mode: str) -> float:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return float(done.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_messages_leave_the_process() -> None:
    kept, returned = _growth("defaults"), _growth("settings")
    assert kept > 40  # the defaults keep three freed 16 MB blocks
    assert returned < 8, f"{returned:.0f} MB still resident after the blocks were freed"
