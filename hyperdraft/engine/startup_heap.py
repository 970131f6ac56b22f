"""The startup heap kept out of Python's cyclic garbage collection, in processes that own one engine for their life:
the server, and each tensor-parallel follower rank.

Building an engine leaves a few hundred thousand container objects alive (torch, transformers, the tokenizer, the
model's modules, the graph runners). The collector's oldest generation walks every one of them each time it runs,
and while it does no step runs: benchmarks/results/gc_pause.md measured the pauses. gc.freeze() moves what is
alive now into a permanent generation that collections skip; what requests allocate later is collected as before.

The Engine does not freeze by itself: frozen objects are never collected, so a process that builds and drops engines
one after another (tests, notebooks, benchmarks) would keep the cyclic garbage of each.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect once, then freeze everything still alive -> how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
