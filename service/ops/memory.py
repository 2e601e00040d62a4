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

Blocks under the threshold still come from the arenas: gRPC core reads a message into
slices of tens of KiB, and the free pages between the blocks still in use stay resident
(glibc trims only the top of a heap). After each large message, `trimmer`'s call hands
them back (malloc_trim): without it a flood of 16 MB messages read one at a time left
+16-38 MB behind and peaked 10-20 MB higher.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
from collections.abc import Callable
from functools import cache

log = logging.getLogger(__name__)

# mallopt parameters, from glibc's malloc.h
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8

ARENAS = 2
THRESHOLD_BYTES = 256 * 1024


@cache
def _glibc() -> ctypes.CDLL | None:
    """The C library where it is glibc (it has mallopt and malloc_trim), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018
    except (OSError, AttributeError):  # musl and others
        return None
    return libc


def return_freed_memory() -> bool:
    """Apply the settings above; False where the C library is not glibc (nothing to do)."""
    if (libc := _glibc()) is None:
        return False
    mallopt = libc.mallopt
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


def trimmer() -> Callable[[], None]:
    """A call that returns the arenas' free pages to the system (a no-op without glibc)."""
    if (libc := _glibc()) is None:
        return lambda: None
    malloc_trim = libc.malloc_trim
    malloc_trim.argtypes = [ctypes.c_size_t]
    return lambda: malloc_trim(0)
