"""NGRAM's draft-ahead: the next round's lookup queued on the device from a round's accepted tokens (kernels/ngram.py
over proposers/ngram_store.DeviceSequences), and the round's verify queued behind it (verify_ahead.py).

The lookup's rule is ngram_match's: the torch reference (what CPU engines run, and what the GPU test holds the
kernels to) equals it on random sequences, histories and page layouts. Engines with it (emulated CUDA graphs on CPU)
produce spec off's tokens, greedy and sampled, under tight pools, aborts and adaptive tiers, with one device-to-host
read per step, and the queued drafts and verifies are in fact used.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hyperdraft import SamplingParams
from hyperdraft.kernels.ngram import ngram_draft_ahead
from hyperdraft.speculative.proposers.ngram import ngram_match
from hyperdraft.testing.tiny import make_tiny_model
from helpers.host_reads import assert_one_read_per_step, reads_per_step
from helpers.token_store import random_history, random_store
from helpers.spec_fixtures import assert_aborted_run_like, _single_torch_thread, gen, greedy, llm_factory, mixed_prompts, run_aborting, spec_off_ids  # noqa: F401

NEW_TOKENS = [6, 40, 9, 34, 4, 28, 8, 44]  # requests finishing at different steps: the batch changes under the queue
NGRAM = dict(speculative_algorithm="NGRAM", speculative_num_steps=4, skip_tokenizer_init=True)
ADAPTIVE = {"ema_alpha": 0.5, "warmup_batches": 1, "update_interval": 1,
            "1": {"candidate_steps": [1, 4]}, "4": {"candidate_steps": [0, 2, 4]}}


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_lookup_ahead_equals_ngram_match(page_size):
    """After the round's a + 1 tokens are appended, each request's drafts and count equal ngram_match over its whole
    sequence (and the history), and the appended tokens sit in their slots."""
    rng = np.random.default_rng(page_size)
    for trial in range(60):
        bsz, k = int(rng.integers(1, 5)), int(rng.integers(1, 6))
        vocab = int(rng.integers(2, 7))  # small vocabularies: matches of every length, in both sources
        lo = int(rng.integers(1, 4))
        hi = int(rng.integers(lo, 9))
        store, rows, seqs = random_store(rng, page_size, [int(rng.integers(1, 60)) for _ in range(bsz)], vocab)
        history, device_history = random_history(rng, vocab, 64)
        num_accepted = torch.tensor(rng.integers(0, k + 1, bsz))
        accepted = torch.tensor(rng.integers(0, vocab, (bsz, k + 2)))[:, : k + 1]  # a strided view, as a round's
        bases = torch.tensor([len(s) for s in seqs])
        drafts = ngram_draft_ahead(store, torch.tensor(rows), bases, num_accepted, accepted, device_history,
                                   len(history), int(bases.max()) + k + 1, k, lo, hi)
        for b, seq in enumerate(seqs):
            full = seq + accepted[b, : int(num_accepted[b]) + 1].tolist()
            slots = store.table[rows[b], torch.arange(len(full)) // page_size] * page_size + \
                torch.arange(len(full)) % page_size
            assert store.tokens[slots].tolist() == full, "appended tokens"
            want = ngram_match(np.asarray(full), k, lo, hi, history).tolist()
            count = int(drafts.lens[b])
            assert count == len(want) and drafts.tokens[b, :count].tolist() == want, (trial, b, full, history)
            assert not drafts.tokens[b, count:].any(), "drafts padded with 0"


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    root = tmp_path_factory.mktemp("ngram_ahead")
    (root / "adaptive.json").write_text(json.dumps(ADAPTIVE))
    return make_tiny_model(str(root / "small"), "llama", num_hidden_layers=2, vocab_size=8, with_tokenizer=False), root


def _prompts(vocab: int = 8) -> list[list[int]]:
    return mixed_prompts(len(NEW_TOKENS), seed=5, vocab=vocab, max_len=40)


def _engine(llm_factory, monkeypatch, path, ahead: str, **args):
    monkeypatch.setenv("HYPERDRAFT_EMULATE_CUDA_GRAPH", "1")
    monkeypatch.setenv("HYPERDRAFT_DRAFT_AHEAD", ahead)
    return llm_factory(path, cuda_graph_max_bs=4, **NGRAM, **args)


def check_queued_drafts(llm, monkeypatch, graph_max_bs: int) -> list[int]:
    """Watch every round a queued draft serves: its drafts must be what the host's lookup finds over each request's
    committed tokens then (so the device held exactly those tokens), zeros past them, and its batch one that a verify
    graph runs (at most graph_max_bs requests). -> [rounds checked]."""
    proposer, checked = llm.engine.worker.proposer, [0]
    propose = proposer.propose

    def watched(reqs, tier, sampling):
        used = proposer.ahead_used
        proposal = propose(reqs, tier, sampling)
        if proposer.ahead_used > used:
            assert len(reqs) <= graph_max_bs, "drafted ahead for a batch no verify graph runs"
            history = proposer.history.tokens
            for b, req in enumerate(reqs):
                want = ngram_match(np.asarray(req.token_ids(0, req.seq_len)), tier.steps, proposer.min_window,
                                   proposer.max_window, history).tolist()
                assert proposal.tokens[b].tolist() == want + [0] * (tier.steps - len(want)), (req.rid, req.seq_len)
            checked[0] += 1
        return proposal

    monkeypatch.setattr(proposer, "propose", watched)
    return checked


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("adaptive", [False, True])
def test_ngram_ahead_changes_nothing(small, llm_factory, monkeypatch, page_size, adaptive):
    path, root = small
    args = dict(page_size=page_size)
    if adaptive:
        args.update(speculative_adaptive=True, speculative_adaptive_config=str(root / "adaptive.json"))
    prompts, params = _prompts(), [greedy(n) for n in NEW_TOKENS]
    llm = _engine(llm_factory, monkeypatch, path, "1", **args)
    checked = check_queued_drafts(llm, monkeypatch, graph_max_bs=4)
    outs = [o.token_ids for o in gen(llm, prompts, params)]
    proposer, queue = llm.engine.worker.proposer, llm.engine.worker.verify_ahead
    assert proposer.ahead_used > 0 and proposer.ahead_discarded > 0, "no queued draft served, or none was dropped"
    assert checked[0] == proposer.ahead_used
    assert queue.used > 0, "no round's verify was queued behind a queued draft"
    off = _engine(llm_factory, monkeypatch, path, "0", **args)
    assert [o.token_ids for o in gen(off, prompts, params)] == outs
    assert off.engine.worker.proposer.ahead_used == 0 and not off.engine.worker.capabilities.drafts_ahead
    # the same drafts either way, and a queued round counts its real drafts (read back with its results), not K
    on_metrics, off_metrics = llm.engine.worker.metrics, off.engine.worker.metrics
    counted = [(m.draft_tokens, m.accepted_tokens) for m in (on_metrics, off_metrics)]
    assert counted[0] == counted[1], counted
    assert outs == spec_off_ids(path, prompts, params)


def test_ngram_ahead_sampled_rows(small, llm_factory, monkeypatch):
    """Rows verified by rejection sampling with drafts queued ahead: top-k 1 at temperature 0.8 must reproduce greedy
    decoding exactly (p is one-hot, so every accept and every recovered token is forced), and seeded sampling is
    reproducible run to run."""
    path, _ = small
    prompts = _prompts()
    forced = [SamplingParams(temperature=0.8, top_k=1, max_new_tokens=n, ignore_eos=True) for n in NEW_TOKENS]
    llm = _engine(llm_factory, monkeypatch, path, "1")
    greedy_ids = spec_off_ids(path, prompts, [greedy(n) for n in NEW_TOKENS])
    assert [o.token_ids for o in gen(llm, prompts, forced)] == greedy_ids
    assert llm.engine.worker.proposer.ahead_used > 0
    seeded = [SamplingParams(temperature=0.9, max_new_tokens=n, ignore_eos=True, seed=3 + i)
              for i, n in enumerate(NEW_TOKENS)]
    first = [o.token_ids for o in gen(llm, prompts, seeded)]
    assert [o.token_ids for o in gen(llm, prompts, seeded)] == first


def test_ngram_ahead_tight_pool_and_abort(small, llm_factory, monkeypatch):
    """Too little room for everyone (retractions move requests to other rows, whose device tokens must be copied
    again) and an abort between steps: outputs stay spec off's, the aborted one a prefix of its own."""
    path, _ = small
    prompts, params = _prompts(), [greedy(n) for n in NEW_TOKENS]
    monkeypatch.setenv("HYPERDRAFT_EMULATE_CUDA_GRAPH", "1")
    llm = llm_factory(path, cuda_graph_max_bs=8, max_total_tokens=120, page_size=4, **NGRAM)
    checked = check_queued_drafts(llm, monkeypatch, graph_max_bs=8)
    reqs = run_aborting(llm.engine, prompts, params, victim=3, at_step=10)
    assert checked[0] == llm.engine.worker.proposer.ahead_used > 0
    assert sum(r.num_retractions for r in reqs) > 0, "the pool was not tight"
    ref = spec_off_ids(path, prompts, params)
    outs = [r.output_ids for r in reqs]
    assert_aborted_run_like(outs, ref, victim=3)


def test_ngram_ahead_one_device_read_per_step(small, llm_factory, monkeypatch):
    path, _ = small
    llm = _engine(llm_factory, monkeypatch, path, "1", page_size=4)
    engine = llm.engine
    for p in _prompts()[:3]:
        engine.add_request(input_ids=p, params=greedy(30))
    # The CPU attention backend and the lookup's torch reference read host data a GPU never asks for.
    per_step = reads_per_step(engine, ("hyperdraft/attention/torch_backend.py", "hyperdraft/kernels/ngram.py"))
    assert engine.worker.proposer.ahead_used > 0
    assert_one_read_per_step(per_step)


def test_ngram_ahead_drafts_from_the_history(small, llm_factory, monkeypatch):
    """A prompt asked again drafts its earlier answer from the device history: the second pass accepts more drafts a
    round than the first, with the same outputs."""
    path, _ = small
    llm = _engine(llm_factory, monkeypatch, path, "1")
    prompts, params = _prompts()[1::2][:3], [greedy(40)] * 3  # random prompts: little to match in themselves
    state = llm.engine.worker.metrics
    first = [o.token_ids for o in gen(llm, prompts, params)]
    accepted_first, verifies_first = state.accepted_tokens, state.verifies
    second = [o.token_ids for o in gen(llm, prompts, params)]
    assert second == first
    assert (state.accepted_tokens - accepted_first) / (state.verifies - verifies_first) > \
        accepted_first / verifies_first + 0.5
    assert llm.engine.worker.proposer.ahead_used > 0
