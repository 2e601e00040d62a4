"""The split server: a supervisor, engine processes that hold the models, and front ends.

- supervisor.py: `pooling-server --frontends N` starts, watches and drains the children;
- engine_process.py: an engine process's main (loads the models, serves front ends over IPC);
- frontend.py: a front end's role (wait for the engines, connect, report ready);
- run_dir.py: the folder they share (IPC endpoints, ready files, metrics).

A child runs `python -m pooling_server.service.launch` with --role engine or --role frontend.
"""
