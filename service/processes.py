"""Several server processes on one port: each a whole server, the kernel spreads connections.

One Python process answers about a thousand small requests a second however fast its device
is (its event loop is the limit), so a fast GPU needs several. Like gRPC's own
multiprocessing example, each child binds the same port with SO_REUSEPORT; this parent only
forwards SIGTERM/SIGINT and fails fast: when one child dies, it stops the rest.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

log = logging.getLogger(__name__)


def run_processes(argv: Sequence[str], count: int) -> int:
    """Run `count` servers with `argv` (each told its index); return the worst exit code."""
    command = [sys.executable, "-m", "service.cli", *argv, "--processes", "1"]
    children = [subprocess.Popen([*command, "--process-index", str(k)]) for k in range(count)]
    log.info("started %d server processes: %s", count, ", ".join(str(c.pid) for c in children))
    stopping = False

    def forward(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    while any(child.poll() is None for child in children):
        failed = next((c for c in children if c.returncode not in (None, 0)), None)
        if failed is not None and not stopping:
            log.error(
                "server process %d exited with %d; stopping the rest", failed.pid, failed.returncode
            )
            forward(signal.SIGTERM, None)
        time.sleep(0.2)
    codes = [child.returncode for child in children]
    return max(codes, key=abs) if any(codes) else 0
