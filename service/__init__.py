"""The gRPC layer: wire mapping, error statuses, the servicer, the server and its CLI."""
