"""The `batchmaker` command and what it runs: the supervisor, the checks before start, and a launcher for tools."""
