"""`pooling-server`: launches the server its flags (service/cli.py) describe.

Which process this is decides what runs: a split server's supervisor
(service/split/supervisor.py) starts the engine and front-end processes, each of which runs
this module again with --role; a front end serves the doors over its engines; an engine
serves its models to the front ends; --frontends 0 serves everything in this one process.
The gRPC door (grpcio's or Node.js's) is chosen here, once, in the first process: a
split server's children are told the answer.
`pooling-server batch` runs an offline job instead (service/batch_job.py).

`python -m pooling_server.service.launch` is the server; `-m pooling_server.service.cli`
still starts it too.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence

from pooling_server.service.cli import config_from_args, parse_args, parse_batch_args
from pooling_server.service.ops import event_loop, logs
from pooling_server.service.ops.config import raise_open_file_limit
from pooling_server.service.split.supervisor import Supervisor

log = logging.getLogger(__name__)


NODE_MAJOR = 20  # the oldest Node.js service/grpc/node_door.mjs is tested on


def node_major() -> int | None:
    """The major version of `node` on PATH; None where there is none or it will not say."""
    node = shutil.which("node")
    if node is None:
        return None
    try:
        said = subprocess.run(
            [node, "--version"], capture_output=True, text=True, timeout=10, check=True
        ).stdout
        return int(said.strip().lstrip("v").split(".")[0])
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def grpc_door(requested: str) -> str:
    """The door `--grpc-door` names, `auto` resolved (once: the supervisor hands its front
    ends the answer). `node` without Node.js 20 on PATH, or without grpc-js installed, is
    refused here, before any model loads."""
    if requested == "grpcio":
        return requested
    from pooling_server.service.grpc import node_door  # grpc's import: only where a door is chosen

    major = node_major()
    found = "no `node` on PATH" if major is None else f"Node.js {major} on PATH"
    if major is None or major < NODE_MAJOR:
        if requested == "node":
            raise SystemExit(
                f"--grpc-door node needs Node.js {NODE_MAJOR} or newer as `node` on PATH "
                f"({found}); install it or serve gRPC with --grpc-door grpcio"
            )
    elif not node_door.installed():
        found = f"no @grpc/grpc-js in {node_door.SCRIPT.parent}"
        if requested == "node":
            raise SystemExit(
                f"--grpc-door node needs @grpc/grpc-js: run `make node-door` in a clone, or "
                f"`npm ci --omit=dev` in {node_door.SCRIPT.parent}; or serve gRPC with "
                "--grpc-door grpcio"
            )
    else:
        log.info("gRPC door: node (Node.js %d on PATH)", major)
        return "node"
    log.info("gRPC door: grpcio (auto: %s; Node.js %d or newer is faster)", found, NODE_MAJOR)
    return "grpcio"


def _batch_job(argv: Sequence[str]) -> int:
    """`pooling-server batch ...`: the models load in this process; no server, no port."""
    from pooling_server.service.batch_job import run_main  # torch and transformers: only for a job

    args, options = parse_batch_args(argv)
    logs.configure(args.log_level, args.log_format)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if options.ray is not None:  # ray is imported by that module alone
        from pooling_server.service.ray_batch import run_main as run_on_ray

        return run_on_ray(config_from_args(args), options)
    return event_loop.run(run_main(config_from_args(args), options), args.event_loop)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["batch"]:  # `pooling-server batch`: an offline job, no server
        return _batch_job(argv[1:])
    args = parse_args(argv)
    if args.role == "engine":
        _ignore_stop_signals()
    logs.configure(args.log_level, args.log_format)
    raise_open_file_limit()  # every server process: supervisor, front ends, engines
    if args.role is None:  # a front end is told the answer, an engine serves no gRPC
        args.grpc_door = grpc_door(args.grpc_door)
        argv = [*argv, "--grpc-door", args.grpc_door]
        # Children are told the layout too: what auto chose here is what they serve.
        argv += ["--frontends", str(args.frontends)]
        argv += ["--engines-per-device", str(args.engines_per_device)]
    config = config_from_args(args)
    if args.role is None and args.frontends > 0:
        if args.frontends > 1 and args.port == 0:
            raise SystemExit("--frontends above 1 needs a fixed --port: the front ends share it")
        if args.frontends > 1 and args.http_port == 0:
            raise SystemExit("--frontends above 1 needs a fixed --http-port: they share it")
        metrics = None if args.metrics_port is None else (args.metrics_host, args.metrics_port)
        engines = args.data_parallel * args.engines_per_device
        return Supervisor(argv, args.frontends, engines, metrics, args.engines_per_device).run()
    if args.role is not None:
        _die_with_parent()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Each role imports only what it runs: an engine process neither grpc nor aiohttp.
    if args.role == "frontend":
        from pooling_server.service.ops.memory import return_freed_memory

        return_freed_memory()  # before any thread that allocates starts
        from pooling_server.service.server import serve
        from pooling_server.service.split.frontend import FrontendRole

        fds = [int(fd) for fd in args.alive_fds.split(",") if fd]
        engines = args.data_parallel * args.engines_per_device
        frontend = FrontendRole(args.role_index, args.frontends, args.run_dir, engines, fds)
        return event_loop.run(serve(config, frontend), args.event_loop)
    from transformers.utils import logging as hf_logging  # a process that loads models

    hf_logging.disable_progress_bar()
    if args.role == "engine":
        from pooling_server.service.split.engine_process import run_engine

        return event_loop.run(
            run_engine(config, args.role_index, args.run_dir, args.stop_fd), args.event_loop
        )
    from pooling_server.service.server import serve

    return event_loop.run(serve(config), args.event_loop)


def _ignore_stop_signals() -> None:
    """An engine stops only when the supervisor closes its stop pipe. The supervisor starts
    it with SIGTERM and SIGINT blocked, so one sent to the group before this line is held,
    then discarded here."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})


def _die_with_parent() -> None:
    """A child of a split server gets SIGTERM if the supervisor dies, even by SIGKILL."""
    if sys.platform == "linux":
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGTERM)


if __name__ == "__main__":
    raise SystemExit(main())
