"""hyperdraft's benchmarks. Run each from the repository root as `python -m benchmarks.<group>.<script>`; see
benchmarks/README.md for the list, what each measures and where its results go.

  e2e/      end-to-end engine runs (engine builders shared in e2e/engines.py)
  kernels/  kernel micro-benchmarks (timing helpers in kernels/timing.py)
  probes/   one-off investigations
  results/  committed results, named <what>_<device>.md (device: cpu, h100, h200)
"""
