"""What the manager reports of itself: the `stats` op, Prometheus metrics, and its memory trace."""
