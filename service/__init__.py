"""The server around the engine: its doors (gRPC, HTTP, batch jobs) over one request runner,
the server's lifecycle, the split server (split/) and the CLI."""
