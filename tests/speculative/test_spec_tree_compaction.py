"""Accepted-path compaction after a tree verify (STANDALONE, topk > 1): the K/V left in both KV pools is exactly
what plain decoding of the committed tokens writes.

A tree verify writes node i of a request's tree at sequence index L + i (L = the root's index), and the draft wrote
the frontier nodes of its beam step s at offsets 1 + (s-1)*topk + f past L. An accepted path root -> v_1 -> .. -> v_a
is generally NOT contiguous in either layout (v_j > j), so after verification the worker moves the accepted nodes'
K/V to L + j in the target pool and, for the leading accepted nodes the draft fed, in the draft pool too. This
test drives an engine step by step and, after every step, compares for every request of the tree round

  target pool, sequence indices 0 .. num_computed - 1        (root .. last accepted node included)
  draft pool,  sequence indices 0 .. draft_num_computed - 1

with the K/V that a plain engine (no speculation) writes when it prefills the same tokens: with the target model
for the target pool, with the draft model as the target for the draft pool (atol 1e-5). Pools are read through the
page tables, so the check holds for page_size 1 and 4. A spy on TreeRound.accept records each round's tree and
the accepted tokens; the test derives the accepted path from them itself and asserts that non-contiguous paths
(a node index > its depth; a draft-fed offset > its depth) really occurred, with the comparison passing after them.
"""

from __future__ import annotations

import pytest
import torch

from hyperdraft import SamplingParams
from hyperdraft.speculative.verify.tree import TreeRound
from helpers.spec_fixtures import _single_torch_thread, greedy, llm_factory, mixed_prompts, spec_models  # noqa: F401

ATOL = 1e-5
TOPK, STEPS, NUM_DRAFT_TOKENS = 2, 4, 8


class RoundSpy:
    """Records every TreeRound.accept: per request (rid, root index L, tree tokens/parents/fed offsets, emitted
    tokens, accept count), before the scheduler commits."""

    def __init__(self, monkeypatch):
        self.rounds: list[list[dict]] = []
        original = TreeRound.accept
        spy = self

        def accept(round_, *args, **kwargs):
            out = original(round_, *args, **kwargs)
            num_accepted, tokens = round_.num_accepted.tolist(), round_.tokens.tolist()
            prop = round_.proposal
            page_table = round_.ctx.target.page_table
            spy.rounds.append([
                dict(req=r, base=r.num_computed, room=page_table.num_slots(r.row) - r.num_computed - 1,
                     tokens=prop.tokens[b].tolist(), parents=prop.parents[b].tolist(), fed=prop.fed[b].tolist(), emitted=tokens[b][: num_accepted[b] + 1], num_accepted=num_accepted[b])
                for b, r in enumerate(round_.reqs)])
            return out

        monkeypatch.setattr(TreeRound, "accept", accept)


def show(rec: dict) -> dict:
    """A round record for failure messages (the request itself is too long to print)."""
    return {"rid": rec["req"].rid, **{k: v for k, v in rec.items() if k != "req"}}


def accepted_path(rec: dict) -> list[int]:
    """Node indices root, v_1 .. v_a, derived from the tree and the emitted tokens (siblings have distinct tokens)."""
    path = [0]
    for tok in rec["emitted"][: rec["num_accepted"]]:
        kids = [i for i, p in enumerate(rec["parents"]) if p == path[-1] and rec["tokens"][i] == tok and i > 0]
        assert len(kids) == 1, f"accepted token {tok} is not exactly one child of node {path[-1]}: {show(rec)}"
        path.append(kids[0])
    return path


def leading_fed(rec: dict, path: list[int]) -> int:
    """Accepted nodes below the root, counted from the top, whose K/V the draft had written into the request's own
    slots (offset <= room: the beam's offsets past the reserved room have no slot of the request)."""
    m = 0
    for v in path[1:]:
        if not 0 <= rec["fed"][v] <= rec["room"]:
            break
        m += 1
    return m


def kv_at(llm, row: int, n: int, pool) -> tuple[torch.Tensor, torch.Tensor]:
    slots = llm.engine.page_table.slots(torch.tensor([row]), torch.arange(n)[None])[0]
    return pool.k[:, slots].clone(), pool.v[:, slots].clone()


def reference_kv(ref_llm, seqs: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Plain prefill of each sequence in ref_llm, then its K/V at sequence indices 0 .. len - 1; requests aborted."""
    engine = ref_llm.engine
    reqs = [engine.add_request(input_ids=s, params=greedy(4)) for s in seqs]
    for _ in range(100):
        if all(r.num_computed >= len(s) for r, s in zip(reqs, seqs)):
            break
        engine.step()
    out = [kv_at(ref_llm, r.row, len(s), engine.runner.pool) for r, s in zip(reqs, seqs)]
    for r in reqs:
        engine.abort(r.rid)
    return out


def assert_kv_close(got, want, what: str):
    for name, g, w in zip("KV", got, want):
        assert g.shape == w.shape, what
        err = (g - w).abs().amax(dim=(0, 2, 3))  # per sequence index
        bad = (err > ATOL).nonzero().flatten().tolist()
        assert not bad, f"{what}: {name} differs from plain decoding at sequence indices {bad} (max err {err.max():.3g})"


def run_and_check(llm, target_ref, draft_ref, prompts, params, spy: RoundSpy, max_steps: int = 400) -> dict:
    topk = llm.engine.spec.topk
    engine = llm.engine
    reqs = [engine.add_request(input_ids=p, params=sp) for p, sp in zip(prompts, params)]
    try:
        return _step_and_check(llm, target_ref, draft_ref, spy, topk, max_steps)
    finally:  # on a failure, leave the engines clean (llm_factory's teardown check) so only the failure reports
        for r in reqs:
            engine.abort(r.rid)


def _step_and_check(llm, target_ref, draft_ref, spy: RoundSpy, topk: int, max_steps: int) -> dict:
    engine = llm.engine
    stats = dict(checked=0, target_noncontig=0, draft_noncontig=0, max_accept=0, fed_past_room=0)
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        n_rounds = len(spy.rounds)
        engine.step()
        if len(spy.rounds) == n_rounds:
            continue
        (records,) = spy.rounds[n_rounds:]
        live = [rec for rec in records if not rec["req"].finished]
        target_refs = reference_kv(target_ref, [rec["req"].token_ids(0, rec["req"].num_computed) for rec in live])
        draft_refs = reference_kv(draft_ref, [rec["req"].token_ids(0, rec["req"].draft_num_computed) for rec in live])
        for rec, t_ref, d_ref in zip(live, target_refs, draft_refs):
            req, base, a = rec["req"], rec["base"], rec["num_accepted"]
            path = accepted_path(rec)
            m = leading_fed(rec, path)
            assert req.num_computed == base + a + 1
            assert req.draft_num_computed == base + 1 + m, (req.draft_num_computed, base, m, show(rec))
            # Fed offsets follow the layout propose_tree documents: step s frontier at 1 + (s-1)*topk + f.
            for v in path[1: 1 + m]:
                depth = path.index(v)
                assert 1 + (depth - 1) * topk <= rec["fed"][v] < 1 + depth * topk, show(rec)
            what = f"request {req.rid} root index {base} path {path} fed {[rec['fed'][v] for v in path]}"
            assert_kv_close(kv_at(llm, req.row, req.num_computed, engine.runner.pool), t_ref, "target pool " + what)
            assert_kv_close(kv_at(llm, req.row, req.draft_num_computed, engine.worker.proposer.runner.pool), d_ref,
                            "draft pool " + what)
            stats["checked"] += 1
            stats["target_noncontig"] += any(v > j for j, v in enumerate(path))
            stats["draft_noncontig"] += any(rec["fed"][v] > j for j, v in enumerate(path[: 1 + m]) if j > 0)
            stats["max_accept"] = max(stats["max_accept"], a)
            stats["fed_past_room"] += any(rec["fed"][v] > rec["room"] for v in path[1:])
    assert not engine.has_unfinished(), "engine did not finish"
    return stats


def tree_args(spec_models, draft="draft_wide_noisy", **kw) -> dict:
    args = dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=spec_models[draft],
                speculative_num_steps=STEPS, speculative_eagle_topk=TOPK, speculative_num_draft_tokens=NUM_DRAFT_TOKENS)
    return {**args, **kw}


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("drafting", ["top-k", "sampled"])
def test_compacted_kv_equals_plain_decoding(spec_models, llm_factory, monkeypatch, drafting, page_size):
    """top-k: the deterministic beam, greedy requests. sampled: speculative_use_rejection_sampling, children drawn
    from q (same fed-offset layout), half the requests sampled at temperature 1 (seeded), half greedy."""
    spy = RoundSpy(monkeypatch)
    llm = llm_factory(spec_models["target"], page_size=page_size,
                      **tree_args(spec_models, speculative_use_rejection_sampling=drafting == "sampled"))
    target_ref = llm_factory(spec_models["target"])
    draft_ref = llm_factory(spec_models["draft_wide_noisy"], skip_tokenizer_init=True)
    prompts = mixed_prompts(8, seed=5, max_len=60)
    params = [greedy(6 + 3 * i) for i in range(len(prompts))]  # different lengths: rows finish mid-batch
    if drafting == "sampled":
        params = [p if i % 2 else SamplingParams(temperature=1.0, max_new_tokens=p.max_new_tokens, ignore_eos=True, seed=i)
                  for i, p in enumerate(params)]
    stats = run_and_check(llm, target_ref, draft_ref, prompts, params, spy)
    # The comparison proves something only if accepted paths were non-contiguous in both layouts, and long.
    assert stats["target_noncontig"] >= 5, stats
    assert stats["draft_noncontig"] >= 5, stats
    assert stats["max_accept"] >= 3, stats


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("drafting", ["top-k", "sampled"])
def test_compacted_kv_with_narrowed_room(spec_models, llm_factory, monkeypatch, drafting, page_size):
    """A lone request whose sequence approaches max_total_tokens: the scheduler reserves fewer slots than a full
    round needs (the verify tree shrinks to the room), while the draft's beam still writes offsets up to
    (steps-1)*topk, the ones past the room into the padding page. An accepted node the draft fed past the room has
    no valid draft K/V: the draft must recompute it, never copy the padding page's contents into its pool.
    topk 4, steps 3, 8 nodes: the beam's depth-2 nodes sit at offsets 5..8 while the tree fits in 8 slots, and the
    exact widened draft gets them accepted."""
    spy = RoundSpy(monkeypatch)
    pool = 64
    args = tree_args(spec_models, draft="draft_wide", speculative_num_steps=3, speculative_eagle_topk=4,
                     speculative_num_draft_tokens=8, speculative_use_rejection_sampling=drafting == "sampled")
    llm = llm_factory(spec_models["target"], page_size=page_size, max_total_tokens=pool, **args)
    target_ref = llm_factory(spec_models["target"])
    draft_ref = llm_factory(spec_models["draft_wide"], skip_tokenizer_init=True)
    totals = dict(checked=0, fed_past_room=0, narrowed=0)
    for seed in range(4):  # one request at a time: only a lone request runs with narrowed room
        prompt = mixed_prompts(2, seed=seed, min_len=40, max_len=40)[1]
        # The sequence grows up to the pool's last slot (prompt + output = pool - 1 tokens).
        params = greedy(pool - len(prompt) - 1)
        if drafting == "sampled" and seed % 2:
            params = SamplingParams(temperature=1.0, max_new_tokens=params.max_new_tokens, ignore_eos=True, seed=seed)
        stats = run_and_check(llm, target_ref, draft_ref, [prompt], [params], spy)
        totals["checked"] += stats["checked"]
        totals["fed_past_room"] += stats["fed_past_room"]
    totals["narrowed"] = sum(rec["room"] + 1 < llm.engine.spec.max_verify_tokens for records in spy.rounds for rec in records)
    assert totals["narrowed"] > 0, totals
    if drafting == "top-k":  # sampled trees number their nodes level by level, so such nodes rarely fit the room
        assert totals["fed_past_room"] > 0, totals
