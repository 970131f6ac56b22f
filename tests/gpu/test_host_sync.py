"""One device-to-host sync per engine step on a GPU, in steady state: the copy of the step's results.

Counted two ways over steady decode steps (every request decoding, graphs captured, kernels compiled):
  - torch.cuda.set_sync_debug_mode("warn"): PyTorch warns at every synchronizing call it makes (item, tolist, nonzero,
    blocking copies in either direction, stream/device synchronize), plus waits on the results copy's CUDA event;
    exactly one per step;
  - torch.profiler: exactly one device-to-host memcpy per step, and no host-to-device copy from pageable memory
    (a pageable copy blocks the host even when nothing warns).
Plain decode, EAGLE-3 chain and tree, sampled trees, NGRAM and STANDALONE; greedy, sampled and penalised requests;
tiny random models, fp32, CUDA graphs on (the default). tests/test_host_sync.py finds the same transfers on CPU.

Run: `PYTHONPATH=. python3 -m pytest tests/gpu/test_host_sync.py -q`. Not part of CI.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from hyperdraft import LLM, SamplingParams
from helpers.host_sync_cases import PARAMS, engine_args, write_models

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GPU_CASES = ["plain", "eagle3-chain", "eagle3-tree", "eagle3-tree-sampled", "eagle3-chain-simulated", "ngram",
             "ngram-trie-tree", "standalone-tree", "eagle3-step-zero"]
RUNS = [(case, params) for case in GPU_CASES for params in ("greedy", "sampled")]
RUNS += [(case, "penalties") for case in ("plain", "eagle3-chain", "eagle3-tree")]
WARMUP_STEPS = 4
MEASURED_STEPS = 6


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return write_models(str(tmp_path_factory.mktemp("host_sync_gpu")))


def _steady_engine(models, case: str, params: dict):
    llm = LLM(models["target"], device="cuda", dtype="float32", skip_tokenizer_init=True, max_total_tokens=8192,
              cuda_graph_max_bs=4, **engine_args(models, case))
    engine = llm.engine
    sp = SamplingParams(max_new_tokens=400, ignore_eos=True, seed=1, **params)
    for prompt in ([5, 6, 7, 8] * 6, list(range(10, 40)), [9] * 11):
        engine.add_request(input_ids=prompt, params=sp)
    while engine.scheduler.waiting or any(r.num_computed < r.seq_len - 1 for r in engine.scheduler.running):
        engine.step()
    for _ in range(WARMUP_STEPS):
        engine.step()
    torch.cuda.synchronize()
    return llm


def _syncs_per_step(engine) -> list[int]:
    """Synchronizing calls per step: PyTorch's sync warnings, plus waits on a CUDA event (the results copy is queued
    and its event waited for, which set_sync_debug_mode does not flag)."""
    counts, event_waits = [], []
    original = torch.cuda.Event.synchronize

    def counted(event):
        event_waits.append(1)
        return original(event)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        torch.cuda.Event.synchronize = counted
        try:
            for _ in range(MEASURED_STEPS):
                before, waits_before = len(caught), len(event_waits)
                outs = engine.step()
                assert len(outs) == 3 and not any(o.finished for o in outs)
                counts.append(sum("synchronizing" in str(w.message) for w in caught[before:])
                              + len(event_waits) - waits_before)
        finally:
            torch.cuda.set_sync_debug_mode(0)
            torch.cuda.Event.synchronize = original
    return counts


def _copies(engine) -> tuple[int, int, list[str]]:
    """-> (device-to-host memcpys, pageable host-to-device memcpys, all memcpy names) over MEASURED_STEPS steps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(MEASURED_STEPS):
            engine.step()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.name.startswith("Memcpy")]
    d2h = sum(n.startswith("Memcpy DtoH") for n in names)
    pageable_h2d = sum(n.startswith("Memcpy HtoD") and "Pageable" in n for n in names)
    return d2h, pageable_h2d, names


@pytest.mark.parametrize("case,params", RUNS, ids=[f"{c}-{p}" for c, p in RUNS])
def test_one_sync_per_step(models, case, params):
    llm = _steady_engine(models, case, PARAMS[params])
    engine = llm.engine
    syncs = _syncs_per_step(engine)
    assert syncs == [1] * MEASURED_STEPS, f"{case} {params}: synchronizing calls per step {syncs}"
    d2h, pageable, names = _copies(engine)
    assert d2h == MEASURED_STEPS, f"{case} {params}: {d2h} device-to-host copies in {MEASURED_STEPS} steps: {names}"
    assert pageable == 0, f"{case} {params}: pageable host-to-device copies: {names}"
    for r in list(engine.scheduler.running):
        engine.abort(r.rid)
    assert engine.flush_cache(), "prefix cache not flushable"  # cached pages are not leaked ones
    assert engine.kv_free_slots == engine.kv_capacity_slots
    llm.shutdown()
