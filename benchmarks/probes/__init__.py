"""One-off investigations (see benchmarks/README.md)."""
