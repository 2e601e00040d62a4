"""A split server: engine processes (one per device) and front-end processes on one port.

Started by `pooling-server --frontends N`. It starts the engines and the front ends
together: front ends listen at once, wait for the engines (see frontend.py) and share
the port with SO_REUSEPORT, as in gRPC's multiprocessing example. It serves the one
/metrics endpoint (prometheus_client's multiprocess mode over the run folder).

With several engines (--data-parallel devices x --engines-per-device), one that dies is
left dead: the front ends fail the calls it held (ENGINE_DEAD) and route the rest to the
others, which serve on. Once no engine is left the server stops and exits non-zero.

The drain is the same whoever gets SIGTERM or SIGINT: this process alone, the whole
process group (systemd's KillMode=control-group, `timeout`, `tini -g`, Ctrl-C) or every
process. The front ends drain (they finish every call they accepted), then the supervisor
closes each engine's stop pipe. Engines ignore both signals and stop only then. A front end
that exits 0 drained on a signal of its own: the supervisor takes that as the start of the
drain, not as a crash. Children start with both signals blocked, so one sent during
start-up is held until the child is ready to handle it. If any child dies otherwise, the
others are stopped and the server exits non-zero so that an orchestrator restarts it.
"""

from __future__ import annotations

import contextlib
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
CHILD_COMMAND = [sys.executable, "-m", "pooling_server.service.launch"]
POLL_S = 0.1
STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})
ENGINE_STOP_S = 30.0  # an engine that has not stopped this long after its pipe closed is killed


class Supervisor:
    def __init__(
        self,
        argv: Sequence[str],
        frontends: int,
        engines: int,
        metrics: tuple[str, int] | None = None,
        engines_per_device: int = 1,
    ) -> None:
        self.argv = list(argv)
        self.frontends = frontends
        self.engines = engines
        self.engines_per_device = engines_per_device
        self.metrics = metrics
        self.run_dir = tempfile.mkdtemp(prefix="pooling-")
        self.stopping = False
        self.signal_name = ""  # the signal that started the drain, logged by the main loop
        self.children: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.stop_pipes: list[int] = []  # the write end of each engine's stop pipe
        self.lost: set[str] = set()  # engines that died while others served on

    def _env(self) -> dict[str, str]:
        from pooling_server.service.split.run_dir import metrics_dir

        env = dict(os.environ)
        env["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir(self.run_dir)
        return env

    def _start(self, role: str, index: int, extra: Sequence[str], fds: Sequence[int]) -> None:
        command = [*CHILD_COMMAND, *self.argv, "--role", role, "--role-index", str(index)]
        command += ["--run-dir", self.run_dir, *extra]
        # The child inherits the blocked mask: it unblocks once it handles (a front end) or
        # ignores (an engine) the signals. Ours, held meanwhile, arrive when we unblock.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            child = subprocess.Popen(command, pass_fds=tuple(fds), env=self._env())
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        self.children.append((f"{role} {index}", child))

    def run(self) -> int:
        from pooling_server.service.split.run_dir import metrics_dir

        os.makedirs(metrics_dir(self.run_dir))
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        try:
            alive_reads = []
            for k in range(self.engines):
                read, write = os.pipe()  # the engine holds the write end; front ends watch
                stop_read, stop_write = os.pipe()  # we hold the write end; the engine watches
                self._start("engine", k, ["--stop-fd", str(stop_read)], [write, stop_read])
                os.close(write)
                os.close(stop_read)
                alive_reads.append(read)
                self.stop_pipes.append(stop_write)
            # Front ends start beside the engines: they listen at once (NOT_SERVING) and
            # connect once every engine has written its ready file.
            fds = ",".join(str(fd) for fd in alive_reads)
            for i in range(self.frontends):
                self._start("frontend", i, ["--alive-fds", fds], alive_reads)
            for fd in alive_reads:
                os.close(fd)
            if self.metrics is not None:
                from pooling_server.service.ops.metrics import serve_multiprocess

                serve_multiprocess(*self.metrics, metrics_dir(self.run_dir))
                log.info("metrics on http://%s:%d/metrics", *self.metrics)
            log.info(
                "started %d engine(s) (%d per device) and %d front end(s): %s",
                self.engines,
                self.engines_per_device,
                self.frontends,
                ", ".join(f"{name} pid {c.pid}" for name, c in self.children),
            )
            while not self.stopping:
                exited = self._exited()
                if exited is not None:
                    name, child = exited
                    left = self._engines_left()
                    if name.startswith("engine") and left:
                        log.error(
                            "%s (pid %d) exited with %d; %d engine(s) serve on",
                            name,
                            child.pid,
                            child.returncode,
                            left,
                        )
                        self._mark_dead(child.pid)
                        self.lost.add(name)
                        continue
                    if name.startswith("frontend") and child.returncode == 0:
                        log.info("%s drained on a signal of its own: draining the rest", name)
                        return self._stop_all(failed=False)
                    log.error("%s (pid %d) exited with %d", name, child.pid, child.returncode)
                    return self._stop_all(failed=True)
                time.sleep(POLL_S)
            log.info("%s: draining the front ends, then stopping the engines", self.signal_name)
            return self._stop_all(failed=False)
        finally:
            for fd in self.stop_pipes:
                with contextlib.suppress(OSError):
                    os.close(fd)
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def _on_signal(self, signum: int, _frame: object) -> None:
        """The first signal starts the drain; later ones (a group signal reaches us beside
        the one we forward, Ctrl-C pressed twice) change nothing."""
        if not self.stopping:
            self.signal_name = signal.Signals(signum).name
            self.stopping = True

    def _exited(self) -> tuple[str, subprocess.Popen[bytes]] | None:
        for name, child in self.children:
            if name not in self.lost and child.poll() is not None:
                return name, child
        return None

    def _engines_left(self) -> int:
        return sum(
            1 for name, child in self.children if name.startswith("engine") and child.poll() is None
        )

    def _stop_all(self, failed: bool) -> int:
        """Front ends first (they drain and finish their calls), then the engines.

        A front end that already drains on a signal of its own takes a second SIGTERM as
        a no-op. Engines ignore signals: closing the stop pipe is what stops them.
        """
        self.stopping = True
        frontends = [c for name, c in self.children if name.startswith("frontend")]
        engines = [(name, c) for name, c in self.children if name.startswith("engine")]
        for child in frontends:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        for child in frontends:
            child.wait()
            self._mark_dead(child.pid)
        for fd in self.stop_pipes:
            os.close(fd)
        self.stop_pipes = []
        for name, child in engines:
            try:
                child.wait(ENGINE_STOP_S)
            except subprocess.TimeoutExpired:
                log.error(
                    "%s (pid %d) did not stop in %.0fs: killed", name, child.pid, ENGINE_STOP_S
                )
                child.kill()
                child.wait()
            self._mark_dead(child.pid)
        for name, child in self.children:
            if child.returncode and not failed:
                log.error("%s (pid %d) exited with %d", name, child.pid, child.returncode)
        if failed:
            return 1
        return 1 if any(c.returncode for _, c in self.children) else 0

    def _mark_dead(self, pid: int) -> None:
        from prometheus_client import multiprocess

        from pooling_server.service.split.run_dir import metrics_dir

        multiprocess.mark_process_dead(pid, metrics_dir(self.run_dir))
