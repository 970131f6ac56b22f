"""Kernel micro-benchmarks (see benchmarks/README.md); timing.py, attention_case.py and gemv_tiles.py are shared."""
