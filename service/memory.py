"""glibc malloc settings for the processes that read clients' messages.

A front end reads up to --max-message-mb per message from anyone. glibc's defaults suit
that poorly: each thread that allocates (gRPC's, aiohttp's, the loop) may get an arena of
its own, and freeing a large block raises the mmap threshold to its size, so the next
flood's messages come from arenas that keep their pages. A flood of 16 MB messages then
grew a fresh server by 200 MB and more, well past the messages in flight. Two arenas and
fixed thresholds make blocks of 256 KiB and more mmapped and unmapped when freed, and a
freed heap top returned at once. Engine processes, and a single-process server
(--frontends 0), keep the defaults: torch's tensors of that size come and go with every
batch, where a fresh mapping each time would cost page faults.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger(__name__)

# mallopt parameters, from glibc's malloc.h
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8

ARENAS = 2
THRESHOLD_BYTES = 256 * 1024


def return_freed_memory() -> bool:
    """Apply the settings above; False where the C library is not glibc (nothing to do)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others: no mallopt
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = all(
        mallopt(param, value) == 1
        for param, value in (
            (M_ARENA_MAX, ARENAS),
            (M_MMAP_THRESHOLD, THRESHOLD_BYTES),
            (M_TRIM_THRESHOLD, THRESHOLD_BYTES),
        )
    )
    if not ok:
        log.warning("mallopt refused a setting: freed memory may be kept longer")
    return ok
