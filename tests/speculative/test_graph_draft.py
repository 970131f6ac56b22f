"""CUDA graphs for the drafter's catch-up extend and tree draft steps, tested on CPU through emulation.

The catch-up feeds each request 1..steps+1 positions; when a graph can run the batch every request is padded to the
captured width (its padding writes draft K/V past the last real position, which the draft steps overwrite) and the
logits come from each request's last real position. Tree draft steps (topk or a sampled tree's smaller frontier per
request, with that depth's tail mask) replay per-depth graphs. Batches above cuda_graph_max_bs, or wider than any
captured catch-up, run eagerly.

Drafts never change the output (verification is lossless), so output == spec off alone cannot catch a broken draft
graph. These tests also require every round's proposal to be the same as with graphs off, and the head's root logits
to equal the head recomputed from scratch.
"""

from __future__ import annotations

import collections
import json

import pytest
import torch

import hyperdraft.speculative.drafting.graphs as draft_graphs
import hyperdraft.speculative.proposers.eagle as eagle_proposer
from hyperdraft import LLM, SamplingParams
from hyperdraft.core.forward_batch import ForwardMode
from hyperdraft.models.decoder import rotated
from hyperdraft.runner.graph_runner import GraphShape
from hyperdraft.models.eagle import target_capture_layers
from hyperdraft.models.eagle_loader import load_eagle_head
from hyperdraft.models.loader import load_model
from hyperdraft.testing.eagle_ckpt import write_random_eagle_checkpoint
from hyperdraft.testing.tiny import make_tiny_model
from helpers.spec_fixtures import assert_aborted_run_like, _single_torch_thread, case_args, gen, run_aborting, greedy, llm_factory, mixed_prompts, spec_models  # noqa: F401

MAX_BS = 4
NEW_TOKENS = [6, 40, 9, 34, 4, 28, 8, 44]  # 8 requests finishing at different steps: eager above 4, graphs below
TREE = dict(speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=6)
CHAIN = dict(speculative_num_steps=3, speculative_eagle_topk=1)
ADAPTIVE = {"ema_alpha": 0.5, "warmup_batches": 1, "update_interval": 1,
            "1": {"candidate_steps": [1, {"steps": 3, "topk": 2, "num_draft_tokens": 6},
                                      {"steps": 4, "topk": 3, "num_draft_tokens": 10}]}}
# Starts at its 1-step chain and never rises (a catch-up of 2) while the tree makes every round graph 5 wide.
NARROW_FIRST = {"1": {"candidate_steps": [1, {"steps": 4, "topk": 3, "num_draft_tokens": 10}], "up_hysteresis": 100.0}}
CASES = {  # (target, drafter, engine args); the 8-token-vocabulary EAGLE pairs accept often: multi-position catch-ups
    "eagle3-chain": ("small", "small_eagle3", dict(speculative_algorithm="EAGLE3", **CHAIN)),
    "eagle3-tree": ("small", "small_eagle3", dict(speculative_algorithm="EAGLE3", **TREE)),
    "eagle1-chain": ("small", "small_eagle", dict(speculative_algorithm="EAGLE", **CHAIN)),
    "standalone-chain": ("target", "draft_wide_noisy", dict(speculative_algorithm="STANDALONE", **CHAIN)),
    "standalone-tree": ("target", "draft_wide_noisy", dict(speculative_algorithm="STANDALONE", **TREE)),
    "eagle3-adaptive": ("small", "small_eagle3", dict(speculative_algorithm="EAGLE3", speculative_adaptive=True,
                                                      speculative_adaptive_config="adaptive.json")),
    "standalone-adaptive": ("target", "draft_wide_noisy", dict(speculative_algorithm="STANDALONE", speculative_adaptive=True,
                                                               speculative_adaptive_config="adaptive.json")),
}
_REF: dict = {}

EMULATE_GRAPHS_ENV = "HYPERDRAFT_EMULATE_CUDA_GRAPH"  # a RuntimeOptions override (hyperdraft/options.py)


@pytest.fixture(scope="module")
def models(spec_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("graph_draft")
    small = make_tiny_model(str(root / "small"), "llama", num_hidden_layers=6, vocab_size=8, with_tokenizer=False)
    (root / "adaptive.json").write_text(json.dumps(ADAPTIVE))
    return dict(spec_models, small=small, root=root,
                small_eagle3=write_random_eagle_checkpoint(str(root / "se3"), small, kind="eagle3", draft_vocab_size=6, seed=3),
                small_eagle=write_random_eagle_checkpoint(str(root / "se1"), small, kind="eagle", seed=4))


@pytest.fixture
def emulated_graphs(monkeypatch):
    monkeypatch.setenv(EMULATE_GRAPHS_ENV, "1")


def _args(models, name: str, **extra) -> tuple[str, dict]:
    return case_args(models, CASES[name], **extra)


def _prompts(target: str) -> list[list[int]]:
    vocab = 8 if target == "small" else 384
    return mixed_prompts(len(NEW_TOKENS), seed=7, vocab=vocab, max_len=40)


def _record(llm: LLM) -> tuple[list, list]:
    """Observe (not replace) the drafter: every round's proposal, and every draft forward's graph match."""
    proposer = llm.engine.worker.proposer
    proposals, matches = [], []
    for name in ("propose",):
        def spy(*args, _inner=getattr(proposer, name), **kw):
            out = _inner(*args, **kw)
            proposals.append([out.tokens.clone()] + ([out.parents.clone()] if hasattr(out, "parents") else [])
                             + ([out.q.clone()] if out.q is not None else []))
            return out
        setattr(proposer, name, spy)
    graphs = proposer.runner.graphs
    if graphs is not None:
        def match(fb, layers, _inner=graphs.match):
            key = _inner(fb, layers)
            matches.append((fb.mode, fb.batch_size, fb.tail_mask is not None, key))
            return key
        graphs.match = match
    return proposals, matches


def _spec_off(path: str, prompts, params) -> list[list[int]]:
    if path not in _REF:  # every test here uses the same prompts and lengths per target
        _REF[path] = [o.token_ids for o in gen(LLM(path, device="cpu", dtype="float32", skip_tokenizer_init=True),
                                               prompts, params)]
    return _REF[path]


def _run(llm_factory, path, prompts, params, **args):
    llm = llm_factory(path, **args)
    proposals, matches = _record(llm)
    return llm, [o.token_ids for o in gen(llm, prompts, params)], proposals, matches


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("name", list(CASES))
def test_draft_graphs_replay_and_change_nothing(models, llm_factory, emulated_graphs, monkeypatch, name, page_size):
    path, args = _args(models, name, page_size=page_size, chunked_prefill_size=16)
    prompts, params = _prompts(CASES[name][0]), [greedy(n) for n in NEW_TOKENS]
    llm, outs, proposals, matches = _run(llm_factory, path, prompts, params, cuda_graph_max_bs=MAX_BS, **args)
    assert outs == _spec_off(path, prompts, params), "graphs on != spec off"
    monkeypatch.delenv(EMULATE_GRAPHS_ENV)
    _, eager_outs, eager_proposals, _ = _run(llm_factory, path, prompts, params, **args)
    assert eager_outs == outs
    assert len(proposals) == len(eager_proposals)
    for i, (a, b) in enumerate(zip(proposals, eager_proposals)):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), f"round {i}: the drafts differ with graphs on"

    proposer = llm.engine.worker.proposer
    target_graphs = llm.engine.worker.runner.graphs
    verified = {shape for (shape, _), n in target_graphs.replays.items() if n and shape.tokens_per_req > 1}
    if name.startswith("eagle3"):  # its fc ran inside the verify graphs (the drafts above would differ otherwise)
        assert verified and verified <= target_graphs.projections.keys()
    else:
        assert not target_graphs.projections
    graphs, loop = proposer.runner.graphs, proposer.draft_loop
    replayed = {shape for (shape, _), n in graphs.replays.items() if n}
    # every greedy round at batch size <= 4, chain or beam, runs as one graph (catch-up and steps), whatever the tiers
    graph_rounds = [p for p in proposals if p[0].shape[1] and p[0].shape[0] <= MAX_BS]
    # ... or was queued ahead by the round before (draft-ahead): replays = rounds + queued drafts not taken
    unused_ahead = proposer.ahead_discarded + (proposer.ahead is not None)
    assert loop.num_replays == len(graph_rounds) + unused_ahead and graph_rounds
    if name in ("eagle3-chain", "eagle1-chain", "eagle3-tree", "standalone-chain", "standalone-tree"):
        # rounds after one of the same batch: drafted ahead
        assert proposer.ahead_used > len(graph_rounds) // 2, (proposer.ahead_used, len(graph_rounds))
    assert not any(s.one_logit for s in replayed), "a catch-up below cuda_graph_max_bs ran on its own"
    if "adaptive" not in name:  # both captured catch-up widths: 1 (after a rejection) and the widest (full acceptance:
        # steps + 1, or 2 for a draft model's chain, whose K/V of accepted drafts stays)
        assert {k.width for k, n in loop.replays.items() if n} == {1, 2 if name == "standalone-chain" else 4}
    if "tree" in name or "adaptive" in name:
        assert any(k.tier.is_tree for k, n in loop.replays.items() if n), "no tree round ran as one graph"
    catch_ups = [(bs, key) for mode, bs, _, key in matches if mode == ForwardMode.DRAFT_EXTEND and bs > MAX_BS]
    assert catch_ups and all(key is None for _, key in catch_ups), "a catch-up above cuda_graph_max_bs must run eagerly"
    steps = [(bs, key) for mode, bs, masked, key in matches if masked]  # tree steps outside a round graph: eager
    assert all(key is None and bs > MAX_BS for bs, key in steps), "a tree step ran on its own below max bs"
    assert "tree" not in name or steps, "no tree round ran above cuda_graph_max_bs"

def _drawn_params() -> list[SamplingParams]:
    """Greedy and seeded sampled requests side by side, with top-k, top-p and min-p on some: as requests finish, the
    batch's sampling flags change, so the rounds need several SamplingKeys."""
    kinds = [dict(temperature=0.0), dict(temperature=0.8, top_k=5), dict(temperature=1.0, top_p=0.9),
             dict(temperature=0.7, min_p=0.1)]
    return [SamplingParams(max_new_tokens=n, ignore_eos=True, seed=100 + i, **kinds[i % len(kinds)])
            for i, n in enumerate(NEW_TOKENS)]


def _penalised_params() -> list[SamplingParams]:
    """Greedy and sampled requests, every one penalised (repetition, frequency, presence)."""
    kinds = [dict(temperature=0.0, repetition_penalty=1.3), dict(temperature=0.8, frequency_penalty=0.4),
             dict(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.2),
             dict(temperature=0.9, top_k=5, repetition_penalty=1.2)]
    return [SamplingParams(max_new_tokens=n, ignore_eos=True, seed=200 + i, **kinds[i % len(kinds)])
            for i, n in enumerate(NEW_TOKENS)]


SAMPLING_KINDS = {  # name -> (engine arguments, requests): rounds whose drafts read the batch's sampling rows
    "drawn": (dict(speculative_use_rejection_sampling=True), _drawn_params),
    "penalised-greedy-drafts": (dict(speculative_use_rejection_sampling=False), _penalised_params),
    "penalised-drawn": (dict(speculative_use_rejection_sampling=True), _penalised_params),
}


@pytest.mark.parametrize("kind", list(SAMPLING_KINDS))
@pytest.mark.parametrize("name", ["eagle3-chain", "eagle3-tree", "standalone-chain", "standalone-tree"])
def test_sampling_rounds_run_as_one_graph_with_the_step_by_step_drafts(models, llm_factory, emulated_graphs,
                                                                        monkeypatch, name, kind):
    """Drafts drawn from q (rejection sampling), or penalised (argmax / top-k of penalised logits, or draws): a round
    at most cuda_graph_max_bs wide runs as one graph per SamplingKey, captured on first use, and drafts what the
    step-by-step round at the same padded shapes drafts (per-step graphs, sampling_round_graphs off; draft-ahead off
    in both, as its catch-ups are padded wider): the same tokens and the same q, bit for bit, every round. With
    draft-ahead (its rows built on the device: positions and penalty counts moved on by the committed tokens), and
    against the unpadded eager rounds, q may differ in the last bits (other GEMM shapes), the drafts and outputs not:
    seeded sampling gives the same tokens, and greedy requests equal spec off."""
    engine_args, make_params = SAMPLING_KINDS[kind]
    path, args = _args(models, name, **engine_args)
    prompts, params = _prompts(CASES[name][0]), make_params()
    llm, outs, proposals, _ = _run(llm_factory, path, prompts, params, cuda_graph_max_bs=MAX_BS, **args)
    proposer = llm.engine.worker.proposer
    ran = [k for k, n in proposer.draft_loop.replays.items() if n]
    assert ran and all(k.sampling is not None for k in ran), f"rounds of a sampling batch in greedy graphs: {ran}"
    assert all(k.sampling.penalised == kind.startswith("penalised") for k in ran)
    assert proposer.ahead_used > 0, "no sampling round was drafted ahead"
    monkeypatch.setenv("HYPERDRAFT_DRAFT_AHEAD", "0")
    _, graphed_outs, graphed, _ = _run(llm_factory, path, prompts, params, cuda_graph_max_bs=MAX_BS, **args)
    monkeypatch.setenv("HYPERDRAFT_SAMPLING_ROUND_GRAPH", "0")
    stepped_llm, stepped_outs, stepped, _ = _run(llm_factory, path, prompts, params, cuda_graph_max_bs=MAX_BS, **args)
    assert stepped_llm.engine.worker.proposer.draft_loop.num_replays == 0
    assert outs == graphed_outs == stepped_outs
    _assert_same_drafts(graphed, stepped, exact_q=True)
    _assert_same_drafts(proposals, stepped, exact_q=False)
    monkeypatch.delenv(EMULATE_GRAPHS_ENV)
    _, eager_outs, eager_proposals, _ = _run(llm_factory, path, prompts, params, **args)
    assert outs == eager_outs, "sampling round graphs changed the outputs"
    _assert_same_drafts(proposals, eager_proposals, exact_q=False)
    greedy_rows = [i for i, p in enumerate(params) if p.temperature == 0]
    spec_off = [o.token_ids for o in gen(LLM(path, device="cpu", dtype="float32", skip_tokenizer_init=True),
                                         [prompts[i] for i in greedy_rows], [params[i] for i in greedy_rows])]
    assert [outs[i] for i in greedy_rows] == spec_off


def test_sampling_round_graphs_are_bounded(models, llm_factory, emulated_graphs, monkeypatch):
    """Past MAX_SAMPLING_GRAPHS, a round with a new SamplingKey runs step by step, with the same drafts."""
    monkeypatch.setattr(draft_graphs, "MAX_SAMPLING_GRAPHS", 1)
    path, args = _args(models, "eagle3-chain", speculative_use_rejection_sampling=True)
    prompts, params = _prompts("small"), _drawn_params()
    llm, outs, proposals, _ = _run(llm_factory, path, prompts, params, cuda_graph_max_bs=MAX_BS, **args)
    proposer = llm.engine.worker.proposer
    assert len({k.sampling for k in proposer.draft_loop.outputs if k.sampling is not None}) == 1
    assert proposer.runner.graphs.replays[(GraphShape(1, 0), 1)] > 0  # other flag sets: per-step graphs
    monkeypatch.delenv(EMULATE_GRAPHS_ENV)
    _, eager_outs, eager_proposals, _ = _run(llm_factory, path, prompts, params, **args)
    assert outs == eager_outs
    _assert_same_drafts(proposals, eager_proposals, exact_q=False)


def _assert_same_drafts(proposals: list, others: list, exact_q: bool) -> None:
    """Round by round: the same draft tokens (and tree parents) and the same q; exact_q False: q to the last bits
    (GEMMs of other shapes round differently)."""
    assert len(proposals) == len(others)
    for i, (a, b) in enumerate(zip(proposals, others)):
        assert len(a) == len(b), f"round {i}"
        for x, y in zip(a, b):
            if x.is_floating_point() and not exact_q:  # q
                torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
            else:
                assert torch.equal(x, y), f"round {i}"


def test_sampled_tree_frontiers_replay_step_by_step(models, llm_factory, emulated_graphs, monkeypatch):
    """Without sampling round graphs (sampling_round_graphs off, or past their bound), drafts drawn from q run step
    by step, each forward through a per-step graph: a sampled tree's level budgets feed frontiers narrower than topk
    (budgets 1, 1, 1 here), whose shapes are captured too. The same drafts as eagerly; greedy requests stay exact."""
    monkeypatch.setenv("HYPERDRAFT_SAMPLING_ROUND_GRAPH", "0")
    path, args = _args(models, "eagle3-tree", speculative_use_rejection_sampling=True, speculative_num_draft_tokens=4)
    prompts, params = _prompts("small"), [greedy(n) for n in NEW_TOKENS]
    llm, outs, proposals, _ = _run(llm_factory, path, prompts, params, cuda_graph_max_bs=MAX_BS, **args)
    graphs = llm.engine.worker.proposer.runner.graphs
    assert {GraphShape(1, 2), GraphShape(1, 4)} <= {s for (s, _), n in graphs.replays.items() if n}
    monkeypatch.delenv(EMULATE_GRAPHS_ENV)
    _, eager_outs, eager_proposals, _ = _run(llm_factory, path, prompts, params, **args)
    assert outs == eager_outs == _spec_off(path, prompts, params)
    _assert_same_drafts(proposals, eager_proposals, exact_q=True)


def test_catch_up_widths_follow_the_tiers_routed_to_each_batch_size(models, llm_factory, emulated_graphs, tmp_path):
    """Adaptive: a batch size captures the widest catch-up its slot's tiers can leave (EAGLE: steps + 1); a catch-up
    wider than that (after a deeper tier at another batch size) has no graph and runs eagerly."""
    cfg = tmp_path / "two_slots.json"
    cfg.write_text(json.dumps({"1": {"candidate_steps": [1, {"steps": 3, "topk": 2, "num_draft_tokens": 6}]},
                               "4": {"candidate_steps": [0, 1]}}))
    llm = llm_factory(models["small"], skip_tokenizer_init=True, speculative_algorithm="EAGLE3",
                      speculative_draft_model_path=models["small_eagle3"], speculative_adaptive=True,
                      speculative_adaptive_config=str(cfg), cuda_graph_max_bs=8, max_running_requests=8)
    graphs = llm.engine.worker.proposer.runner.graphs
    extend = {s: sizes for s, sizes in graphs.sizes.items() if s.one_logit}
    assert extend == {GraphShape(4, 0, True): [1, 2], GraphShape(2, 0, True): [4, 8]}
    assert {GraphShape(2, 3), GraphShape(2, 5)} <= set(graphs.sizes)  # the tree tier's beam steps, slot 1 only
    assert graphs.sizes[GraphShape(2, 5)] == [1, 2]
    assert graphs.extend_width(2, 3) == 4 and graphs.extend_width(2, 1) == 1  # 1: the one-token decode graph
    assert graphs.extend_width(5, 2) == 2 and graphs.extend_width(5, 3) is None and graphs.extend_width(9, 1) is None


@pytest.mark.parametrize("name", ["eagle3-adaptive", "standalone-adaptive"])
def test_adaptive_tiers_narrower_than_the_graphs_draft_ahead(models, llm_factory, emulated_graphs, name):
    """Under adaptive tiers a batch size's round graphs pad the catch-up to the widest that any tier routed there can
    leave (here a 1-step chain, where the ladder starts and stays, and a 4-step tree). A narrower tier's round drafts ahead into that padded graph too, its
    room reserved for the padding, and its next verify is queued behind it; before, only the widest tier drafted
    ahead, and EMA adaptive at batch 1 ran every round cold on a GPU. Outputs stay those of spec off."""
    (models["root"] / "narrow_first.json").write_text(json.dumps(NARROW_FIRST))
    path, args = _args(models, name, page_size=4, speculative_num_steps=1,
                       speculative_adaptive_config="narrow_first.json")
    prompts, params = _prompts(CASES[name][0]), [greedy(n) for n in NEW_TOKENS]
    llm = llm_factory(path, cuda_graph_max_bs=MAX_BS, **args)
    worker = llm.engine.worker
    proposer = worker.proposer
    queued = collections.Counter()  # (tier, drafted ahead?) per draft_ahead call: observed, not changed

    def draft_ahead(reqs, tier, *rest, _inner=proposer.draft_ahead):
        out = _inner(reqs, tier, *rest)
        queued[tier, out is not None] += 1
        return out

    proposer.draft_ahead = draft_ahead
    assert [o.token_ids for o in gen(llm, prompts, params)] == _spec_off(path, prompts, params)
    widest = max(w for by_size in proposer.draft_loop.widths.values() for ws in by_size.values() for w in ws)
    assert widest == 5  # the tree's root plus 4 accepted nodes
    narrower = {tier for tier, ahead in queued if ahead and proposer.catch_up_width(tier) < widest}
    assert narrower, f"only the widest tier drafted ahead: {dict(queued)}"
    assert proposer.ahead_used > 0 and worker.verify_ahead.used > 0


@pytest.mark.parametrize("algo,head", [("EAGLE3", "small_eagle3"), ("EAGLE", "small_eagle")])
@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_padded_catch_up_root_logits_match_recomputation(models, llm_factory, emulated_graphs, monkeypatch, algo, head,
                                                         shape):
    """With graphs, the head's root logits after every padded catch-up equal the head run from scratch over the
    whole sequence: the padding never reaches a position the head later relies on, and the logits come from each
    request's last real position."""
    seen = []
    original = eagle_proposer.EagleProposer.catch_up

    def spy(self, reqs, tokens_in=None):
        counts = [r.num_computed - r.draft_num_computed for r in reqs]
        seqs = [r.prompt_ids + r.output_ids for r in reqs]
        width = self.runner.graphs.extend_width(len(reqs), max(counts))
        fb, out = original(self, reqs, tokens_in)
        seen.extend((s, width, row) for s, row in zip(seqs, out.target_logits().clone()))
        return fb, out

    monkeypatch.setattr(eagle_proposer.EagleProposer, "catch_up", spy)
    monkeypatch.setenv("HYPERDRAFT_DRAFT_LOOP_GRAPH", "0")  # chains too: their catch-up alone (the loop graph hides it)
    llm = llm_factory(models["small"], page_size=4, skip_tokenizer_init=True, cuda_graph_max_bs=MAX_BS,
                      speculative_algorithm=algo, speculative_draft_model_path=models[head], **shape)
    gen(llm, _prompts("small")[:MAX_BS], [greedy(24)] * MAX_BS)
    padded = [x for x in seen if x[1] is not None and x[1] > 1]
    assert len(padded) >= 4, "no padded catch-up ran"

    target = load_model(models["small"], "float32", torch.device("cpu"))
    head_model = load_eagle_head(models[head], target)
    for seq, _, logits in padded:
        ref = _reference_root_logits(target, head_model, seq)
        # fp32 summation order differs (paged, padded vs one pass): ~1e-5 relative; a bookkeeping error is O(1).
        assert torch.allclose(logits, ref, atol=2e-3, rtol=1e-4), (len(seq), (logits - ref).abs().max())



@pytest.mark.parametrize("name,pool", [("eagle3-chain", 140), ("eagle3-tree", 140), ("standalone-chain", 95),
                                       ("standalone-tree", 110)])
def test_draft_ahead_under_a_tight_pool_and_aborts(models, llm_factory, emulated_graphs, monkeypatch, name, pool):
    """Draft-ahead reserves the next round's room when it queues a draft. With a pool too small for every request's
    extra room (retractions happen) it must skip, not fail; a request aborted between two steps makes the next round
    a different batch, whose queued draft is thrown away. Outputs stay those of spec off, the drafts those of
    draft-ahead off, and the pool ends empty (llm_factory checks)."""
    path, args = _args(models, name, page_size=4)
    prompts, params = _prompts(CASES[name][0]), [greedy(n) for n in NEW_TOKENS]

    def run(ahead: str):
        monkeypatch.setenv("HYPERDRAFT_DRAFT_AHEAD", ahead)
        llm = llm_factory(path, cuda_graph_max_bs=8, max_total_tokens=pool, **args)
        proposals, _ = _record(llm)
        engine = llm.engine
        proposer, page_table = engine.worker.proposer, engine.page_table
        refused = []  # reservations draft-ahead asked for and did not get (observed, not changed)

        def draft_ahead(*a, _inner=proposer.draft_ahead, _reserve=page_table.reserve_ahead):
            def reserve_ahead(rows, num_tokens):
                ok = _reserve(rows, num_tokens)
                refused.extend([] if ok else [num_tokens])
                return ok
            page_table.reserve_ahead = reserve_ahead
            try:
                return _inner(*a)
            finally:
                page_table.reserve_ahead = _reserve

        proposer.draft_ahead = draft_ahead
        reqs = run_aborting(engine, prompts, params, victim=3, at_step=12)
        return engine, reqs, proposals, refused

    engine, reqs, proposals, refused = run("1")
    proposer = engine.worker.proposer
    assert proposer.ahead_used > 0 and proposer.ahead_discarded > 0
    assert refused and sum(r.num_retractions for r in reqs) > 0, "the pool was not tight"
    outs = [r.output_ids for r in reqs]
    _, plain_reqs, plain_proposals, _ = run("0")
    plain_outs = [r.output_ids for r in plain_reqs]
    assert outs == plain_outs
    assert len(proposals) == len(plain_proposals)
    assert all(torch.equal(x, y) for a, b in zip(proposals, plain_proposals) for x, y in zip(a, b)), \
        "draft-ahead changed a draft"
    ref = _spec_off(path, prompts, params)
    assert_aborted_run_like(outs, ref, victim=3)

def _causal(layer_id, q, k, v, rope=None):
    q, k = rotated(q, k, rope)
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                           is_causal=True, enable_gqa=True)
    return out.transpose(0, 1)


@torch.inference_mode()
def _reference_root_logits(target, head, seq: list[int]) -> torch.Tensor:
    """The head's logits for the token after seq[-1], from scratch: target hidden h_0..h_{n-1} over seq[:-1], head
    positions 0..n-1 fed (h_i, seq[i+1])."""
    n = len(seq) - 1
    final, captured = target(torch.tensor(seq[:-1]), torch.arange(n), _causal, target_capture_layers(head))
    hidden = head.project_target_hidden(torch.cat(captured, -1)) if captured else final
    g = head(torch.tensor(seq[1:]), torch.arange(n), hidden, _causal)
    return head.compute_logits(g[-1:])[0]
