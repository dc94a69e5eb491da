"""The benchmark suite: cellular vs padded vs graph batching vs the raw kernel (`./scripts/bench`)."""
