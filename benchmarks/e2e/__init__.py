"""End-to-end engine benchmarks (see benchmarks/README.md); e2e/engines.py builds the GPU scripts' engines."""
