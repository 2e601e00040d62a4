"""The server's one import root: `pooling_server.engine` and `pooling_server.service`.

The repository keeps `engine/` and `service/` at its top (setup.py maps them here), but an
installed server claims no generic top-level name, so a user's own module called `service`
or `engine` (in a Ray worker's environment, say) does not collide with it.
"""
