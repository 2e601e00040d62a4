"""A split server: engine processes (one per device) and front-end processes on one port.

Started by `pooling-server --frontends N`. It starts the engines and the front ends
together: front ends listen at once, wait for the engines (see FrontendRole) and share
the port with SO_REUSEPORT, as in gRPC's multiprocessing example. It serves the one
/metrics endpoint (prometheus_client's multiprocess mode over the run folder). On
SIGTERM or SIGINT the front ends drain first, then the engines stop. If any child dies,
the others are stopped and the server exits non-zero so that an orchestrator restarts it.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

log = logging.getLogger(__name__)

# The command a child runs, before its arguments; the benchmark's device stand-in swaps it.
CHILD_COMMAND = [sys.executable, "-m", "service.cli"]
POLL_S = 0.1


class Supervisor:
    def __init__(
        self,
        argv: Sequence[str],
        frontends: int,
        engines: int,
        metrics: tuple[str, int] | None = None,
    ) -> None:
        self.argv = list(argv)
        self.frontends = frontends
        self.engines = engines
        self.metrics = metrics
        self.run_dir = tempfile.mkdtemp(prefix="pooling-")
        self.stopping = False
        self.children: list[tuple[str, subprocess.Popen[bytes]]] = []

    def _env(self) -> dict[str, str]:
        from service.run_dir import metrics_dir

        env = dict(os.environ)
        env["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir(self.run_dir)
        return env

    def _start(self, role: str, index: int, extra: Sequence[str], fds: Sequence[int]) -> None:
        command = [*CHILD_COMMAND, *self.argv, "--role", role, "--role-index", str(index)]
        command += ["--run-dir", self.run_dir, *extra]
        child = subprocess.Popen(command, pass_fds=tuple(fds), env=self._env())
        self.children.append((f"{role} {index}", child))

    def run(self) -> int:
        from service.run_dir import metrics_dir

        os.makedirs(metrics_dir(self.run_dir))
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        try:
            alive_reads = []
            for k in range(self.engines):
                read, write = os.pipe()  # the engine holds the write end; front ends watch
                self._start("engine", k, [], [write])
                os.close(write)
                alive_reads.append(read)
            # Front ends start beside the engines: they listen at once (NOT_SERVING) and
            # connect once every engine has written its ready file.
            fds = ",".join(str(fd) for fd in alive_reads)
            for i in range(self.frontends):
                self._start("frontend", i, ["--alive-fds", fds], alive_reads)
            for fd in alive_reads:
                os.close(fd)
            if self.metrics is not None:
                from service.metrics import serve_multiprocess

                serve_multiprocess(*self.metrics, metrics_dir(self.run_dir))
                log.info("metrics on http://%s:%d/metrics", *self.metrics)
            log.info(
                "started %d engine(s) and %d front end(s): %s",
                self.engines,
                self.frontends,
                ", ".join(f"{name} pid {c.pid}" for name, c in self.children),
            )
            while not self.stopping:
                if self._failed():
                    return self._stop_all(failed=True)
                time.sleep(POLL_S)
            return self._stop_all(failed=False)
        finally:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def _on_signal(self, _signum: int, _frame: object) -> None:
        self.stopping = True

    def _failed(self) -> bool:
        for name, child in self.children:
            if child.poll() is not None:
                log.error("%s (pid %d) exited with %d", name, child.pid, child.returncode)
                return True
        return False

    def _stop_all(self, failed: bool) -> int:
        """Front ends first (they drain and finish their calls), then the engines."""
        for role in ("frontend", "engine"):
            group = [c for name, c in self.children if name.startswith(role)]
            for child in group:
                if child.poll() is None:
                    child.send_signal(signal.SIGTERM)
            for child in group:
                try:
                    child.wait()
                except KeyboardInterrupt:  # a second Ctrl-C: stop waiting
                    child.kill()
                    child.wait()
                self._mark_dead(child.pid)
        if failed:
            return 1
        return 1 if any(c.returncode for _, c in self.children) else 0

    def _mark_dead(self, pid: int) -> None:
        from prometheus_client import multiprocess

        from service.run_dir import metrics_dir

        multiprocess.mark_process_dead(pid, metrics_dir(self.run_dir))
