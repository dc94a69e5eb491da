"""Worker process: device arenas, task issuer, stream, signal counter and poller."""
