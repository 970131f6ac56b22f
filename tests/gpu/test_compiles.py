"""Triton kernels compile while an engine warms up, not later. A kernel compiles once per combination of its
constexprs and of the alignment class of each pointer argument (16-byte aligned or not); a forward's int tensors
used to be split out of one packed copy at offsets that depend on the batch's sizes, so a batch size not met before
could compile the attention kernel again (~1 s each on an H100, seen in timed runs and as serving stalls). Here the
same prompts run in batches of 3, 5, 1 and 7, then regrouped into batches of 2, 6, 1 and 4 (a batch-size class
each of the first pass had, every batch holding a prompt over 128 tokens as before: the key bound picks the split
count): the second pass must compile nothing (new entries in the fresh Triton cache directory of a process of its
own, as the in-process cache would hide what an earlier case compiled).

The round kernels get a second test: an adaptive ladder picks its tier by acceptance, so a tier can first run in
the middle of serving; every chain tier up to 7 steps, at several batch sizes, must share one binary per kernel
(first_use_compiles_h100.md: a 3-step tier compiled _accept_chain and _pack_catch_up in a timed run).

Run: `python -m pytest tests/gpu/test_compiles.py -q`. Not part of CI.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

LENGTHS = [130, 7, 300, 45, 180, 12, 260, 90, 33, 150, 70, 210]  # every request's prompt, in every grouping
FIRST = [[0, 1, 3], [2, 4, 5, 6, 7], [2], [9, 10, 11, 0, 1, 3, 8]]
SECOND = [[1, 2], [3, 4, 5, 6, 7, 8], [6], [9, 10, 11, 0]]


def _kernels(cache: str, entries: set[str]) -> list[str]:
    names = []
    for entry in sorted(entries):
        names += [os.path.basename(f)[:-5] for f in glob.glob(os.path.join(cache, entry, "*.json"))
                  if not os.path.basename(f).startswith("__grp__")]
    return names


def _passes(deterministic: bool, graphs: bool, root: str) -> dict:
    """Both passes in this process (a fresh one: the caller sets TRITON_CACHE_DIR) -> what the second compiled."""
    from hyperdraft import LLM, SamplingParams
    from hyperdraft.testing.tiny import make_tiny_model

    cache = os.environ["TRITON_CACHE_DIR"]
    listing = lambda: set(os.listdir(cache)) if os.path.isdir(cache) else set()  # noqa: E731
    target = make_tiny_model(os.path.join(root, "target"), "llama", seed=0)
    llm = LLM(target, device="cuda", dtype="bfloat16", skip_tokenizer_init=True, max_total_tokens=16384,
              disable_cuda_graph=not graphs, cuda_graph_max_bs=4, enable_deterministic_inference=deterministic)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 384, (n,), generator=g).tolist() for n in LENGTHS]
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    outputs = {}
    for groups in (FIRST, SECOND):
        before = listing()
        for group in groups:
            llm.flush_cache()
            outs = llm.generate(input_ids=[prompts[i] for i in group], sampling_params=params, use_tqdm=False)
            for i, o in zip(group, outs):
                outputs.setdefault(i, []).append(o.token_ids)
    llm.shutdown()
    return {"first": len(before), "new": _kernels(cache, listing() - before),
            "same": all(len({tuple(t) for t in runs}) == 1 for runs in outputs.values())}


def _round_kernel_keys() -> dict[str, int]:
    """Specialization keys each round kernel takes over every chain tier of 1-7 steps at 1, 3 and 16 requests."""
    import triton

    from hyperdraft.kernels.draft_plan import PACKED_FIELDS, accept_chain, pack_catch_up, round_plan

    keys: dict[str, int] = {}
    triton.knobs.runtime.jit_cache_hook = lambda *, fn, **_: keys.__setitem__(fn.name, keys.get(fn.name, 0) + 1)
    g = torch.Generator(device="cuda").manual_seed(0)
    for steps in range(1, 8):
        for bsz in (1, 3, 16):
            draft = torch.randint(0, 4, (bsz, steps), device="cuda", generator=g)
            target = torch.randint(0, 4, (bsz, steps + 1), device="cuda", generator=g)
            num_accepted, tokens = accept_chain(target, draft, torch.full((bsz,), steps, device="cuda"))
            rows_starts = torch.stack([torch.arange(bsz, device="cuda"), torch.full((bsz,), 10, device="cuda")], 1)
            packed = torch.empty(bsz, PACKED_FIELDS + steps + 1, dtype=torch.int64, device="cuda")
            pack_catch_up(rows_starts, num_accepted, tokens, packed)
            table = torch.arange(1, bsz * 64 + 1, device="cuda").view(bsz, 64)
            round_plan(packed, table, 1, steps - 1, 1, 1)
    torch.cuda.synchronize()
    return keys


def test_every_chain_tier_shares_the_round_kernels(tmp_path):
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"))
    run = subprocess.run([sys.executable, __file__, "rounds"], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    keys = json.loads(run.stdout.strip().splitlines()[-1])
    assert set(keys) == {"_accept_chain", "_pack_catch_up", "_round_plan"}, keys
    assert all(n == 1 for n in keys.values()), f"keys per kernel over the tiers: {keys}"


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("graphs", [False, True])
def test_regrouped_batches_compile_nothing_new(tmp_path, deterministic, graphs):
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"))
    run = subprocess.run([sys.executable, __file__, str(int(deterministic)), str(int(graphs)), str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["first"] > 0, "the first pass compiled nothing: the cache directory is not the one Triton writes"
    assert not result["new"], f"compiled after the first pass: {result['new']}"
    if deterministic:  # batch-invariant kernels: regrouping changes no token
        assert result["same"]


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    if sys.argv[1] == "rounds":
        print(json.dumps(_round_kernel_keys()))
    else:
        print(json.dumps(_passes(bool(int(sys.argv[1])), bool(int(sys.argv[2])), sys.argv[3])))
