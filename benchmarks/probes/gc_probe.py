"""Is Python's cyclic GC a visible share of a speculative round? Times an EAGLE-3 chain-5 decode at batch 1 (8B-shaped
dummy target) with GC time measured through gc.callbacks, before and after gc.freeze(). GPU only; prints its lines.

  python -m benchmarks.probes.gc_probe
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time

from benchmarks.common import require_cuda
from benchmarks.e2e.engines import (LLAMA_8B, SPEC_REPEATS, SharedWeights, decode_run, eagle3_spec, make_engine,
                                    median_run, write_configs)

spent = {"s": 0.0, "n": 0}
_t0 = [0.0]


def _cb(phase, info):
    if phase == "start":
        _t0[0] = time.perf_counter()
    else:
        spent["s"] += time.perf_counter() - _t0[0]
        spent["n"] += 1


def main() -> None:
    argparse.ArgumentParser(prog="python -m benchmarks.probes.gc_probe", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    require_cuda()
    gc.callbacks.append(_cb)
    target, head = write_configs(tempfile.mkdtemp(), LLAMA_8B, 32000)
    SharedWeights()
    for name, spec in (("plain", None), ("chain5", eagle3_spec(head, steps=5, topk=1, num_draft_tokens=6, alpha=0.8))):
        engine, _ = make_engine(target, "cuda", 32, spec, 64 * 832)
        decode_run(engine, 1, 32, 8, seed=0)
        for label in ("before freeze", "after freeze"):
            if label == "after freeze":
                gc.collect()
                gc.freeze()
            spent.update(s=0.0, n=0)
            run = median_run(engine, 1, 512, 256, seed=1, repeats=SPEC_REPEATS if spec else 8)
            print(f"{name} {label}: {run['tok_per_s']:.1f} tok/s, {run['step_ms']:.3f} ms/step (median run), "
                  f"accept {run['accept_length'] or 0:.2f}, "
                  f"gc {1000 * spent['s'] / run['engine_steps']:.3f} ms/step in {spent['n']} collections", flush=True)
        gc.unfreeze()


if __name__ == "__main__":
    main()
