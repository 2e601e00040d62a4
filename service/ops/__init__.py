"""What every server process runs beside the doors: configuration, logs, metrics,
telemetry, auth, malloc settings, the event loop and the version."""
