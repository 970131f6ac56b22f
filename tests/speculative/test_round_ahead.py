"""A drafted round's next verify, queued with the next draft before the host reads the round's results
(speculative/verify_ahead.py, RuntimeOptions.round_ahead), tested on CPU through emulated CUDA graphs.

The queued verify feeds each request its next rows (a chain's [bonus, next drafts], a tree's nodes) at indices that
depend on its accept count, known only on the device: next_round_batch moves this round's verify batch on by each
count on the device. These tests check a chain's batch against one built from the true counts, and that engines
(chains and trees, EAGLE heads and a STANDALONE draft model) with round-ahead on produce what
round-ahead off and spec off produce (greedy, seeded sampling, penalties with logprobs), under tight pools, aborts
and adaptive tiers, with one device-to-host read per step, and that queued verifies were in fact used.
"""

from __future__ import annotations

import json

import pytest
import torch

from hyperdraft import SamplingParams
from hyperdraft.core.forward_batch import ForwardInput, ForwardMode, build_forward_batch
from hyperdraft.kvcache.page_table import PageTable
from hyperdraft.request import Request
from hyperdraft.speculative.proposal import Proposal
from hyperdraft.speculative.verify_ahead import next_round_batch
from hyperdraft.testing.eagle_ckpt import write_random_eagle_checkpoint
from hyperdraft.testing.tiny import make_tiny_model
from helpers.host_reads import assert_one_read_per_step, reads_per_step
from helpers.spec_fixtures import assert_aborted_run_like, _single_torch_thread, case_args, gen, run_aborting, greedy, llm_factory, mixed_prompts, spec_models, spec_off_ids  # noqa: F401

NEW_TOKENS = [6, 40, 9, 34, 4, 28, 8, 44]  # requests finishing at different steps: the batch changes under the queue
CHAIN = dict(speculative_num_steps=3, speculative_eagle_topk=1)
TREE = dict(speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=6)
ADAPTIVE = {"ema_alpha": 0.5, "warmup_batches": 1, "update_interval": 1,
            "1": {"candidate_steps": [1, 3, {"steps": 4, "topk": 2, "num_draft_tokens": 6}]},
            "4": {"candidate_steps": [0, 2]}}
CASES = {  # (target, drafter, engine args)
    "eagle3": ("small", "small_eagle3", dict(speculative_algorithm="EAGLE3", **CHAIN)),
    "eagle1": ("small", "small_eagle", dict(speculative_algorithm="EAGLE", **CHAIN)),
    "standalone": ("target", "draft_wide_noisy", dict(speculative_algorithm="STANDALONE", **CHAIN)),
    "eagle3-tree": ("small", "small_eagle3", dict(speculative_algorithm="EAGLE3", **TREE)),
    "standalone-tree": ("target", "draft_wide_noisy", dict(speculative_algorithm="STANDALONE", **TREE)),
    "eagle3-adaptive": ("small", "small_eagle3", dict(speculative_algorithm="EAGLE3", speculative_adaptive=True,
                                                      speculative_adaptive_config="adaptive.json")),
}


@pytest.fixture(scope="module")
def models(spec_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("round_ahead")
    small = make_tiny_model(str(root / "small"), "llama", num_hidden_layers=4, vocab_size=8, with_tokenizer=False)
    (root / "adaptive.json").write_text(json.dumps(ADAPTIVE))
    return dict(spec_models, small=small, root=root,
                small_eagle3=write_random_eagle_checkpoint(str(root / "e3"), small, kind="eagle3", draft_vocab_size=6,
                                                           seed=3),
                small_eagle=write_random_eagle_checkpoint(str(root / "e1"), small, kind="eagle", seed=4))


def _args(models, name: str, **extra) -> tuple[str, dict]:
    return case_args(models, CASES[name], **extra)


def _prompts(name: str) -> list[list[int]]:
    return mixed_prompts(len(NEW_TOKENS), seed=7, vocab=8 if CASES[name][0] == "small" else 384, max_len=40)


def _run(llm_factory, monkeypatch, path, args, prompts, params, ahead: str):
    monkeypatch.setenv("HYPERDRAFT_EMULATE_CUDA_GRAPH", "1")
    monkeypatch.setenv("HYPERDRAFT_ROUND_AHEAD", ahead)
    llm = llm_factory(path, cuda_graph_max_bs=4, **args)
    outs = gen(llm, prompts, params)
    return llm.engine.worker.verify_ahead, outs


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("name", list(CASES))
def test_queued_round_verify_changes_nothing(models, llm_factory, monkeypatch, name, page_size):
    path, args = _args(models, name, page_size=page_size)
    prompts, params = _prompts(name), [greedy(n) for n in NEW_TOKENS]
    queue, outs = _run(llm_factory, monkeypatch, path, args, prompts, params, "1")
    queue_off, off = _run(llm_factory, monkeypatch, path, args, prompts, params, "0")
    assert queue.used > 0 and queue.dropped > 0, "no queued verify served a round, or none was ever dropped"
    # verifies queued ahead are captured as one graph each; none is without round-ahead, nor is any decode graph
    whole = queue.runner.graphs.whole
    assert whole and all(s.tokens_per_req > 1 for s in whole) and not queue_off.runner.graphs.whole
    ids = [o.token_ids for o in outs]
    assert ids == [o.token_ids for o in off]
    assert ids == spec_off_ids(path, prompts, params)


@pytest.mark.parametrize("name", ["eagle3", "standalone"])
@pytest.mark.parametrize("kind", ["sampled", "penalised"])
def test_sampled_rounds_equal_round_ahead_off(models, llm_factory, monkeypatch, name, kind):
    """Seeded sampling draws the same tokens whether a round's verify was queued ahead or not, and penalties and
    logprobs read the same logits."""
    path, args = _args(models, name, page_size=4, speculative_use_rejection_sampling=True)
    extra = dict(temperature=0.9, top_k=6) if kind == "sampled" else dict(
        temperature=0.7, repetition_penalty=1.3, presence_penalty=0.2, return_logprob=True)
    prompts = _prompts(name)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True, seed=11 + i, **extra) for i, n in enumerate(NEW_TOKENS)]
    queue, outs = _run(llm_factory, monkeypatch, path, args, prompts, params, "1")
    _, off = _run(llm_factory, monkeypatch, path, args, prompts, params, "0")
    assert queue.used > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in off]
    if kind == "penalised":  # the CPU backend's queued verify attends over its bound's keys (masked): fp32 rounding
        for a, b in zip(outs, off):
            got, want = a.meta_info["output_token_logprobs"], b.meta_info["output_token_logprobs"]
            assert len(got) == len(want) and torch.allclose(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name,pool", [("eagle3", 90), ("standalone", 80)])
def test_tight_pool_and_abort(models, llm_factory, monkeypatch, name, pool):
    """Queuing reserves the next round's room; with too little for everyone (retractions happen) it must skip, not
    fail, and a request aborted between two steps makes the next round another batch, whose queued verify is
    dropped. Outputs stay spec off's (the aborted one a prefix of its own), and the pool ends empty (llm_factory)."""
    path, args = _args(models, name, page_size=4)
    prompts, params = _prompts(name), [greedy(n) for n in NEW_TOKENS]
    monkeypatch.setenv("HYPERDRAFT_EMULATE_CUDA_GRAPH", "1")
    llm = llm_factory(path, cuda_graph_max_bs=8, max_total_tokens=pool, **args)
    engine = llm.engine
    reqs = run_aborting(engine, prompts, params, victim=3, at_step=12)
    queue = engine.worker.verify_ahead
    assert queue.used > 0 and queue.dropped > 0
    assert sum(r.num_retractions for r in reqs) > 0, "the pool was not tight"
    ref = spec_off_ids(path, prompts, params)
    outs = [r.output_ids for r in reqs]
    assert_aborted_run_like(outs, ref, victim=3)


def test_one_device_read_per_step(models, llm_factory, monkeypatch):
    path, args = _args(models, "eagle3", page_size=4)
    monkeypatch.setenv("HYPERDRAFT_EMULATE_CUDA_GRAPH", "1")
    llm = llm_factory(path, cuda_graph_max_bs=4, **args)
    engine = llm.engine
    for p in _prompts("eagle3")[:3]:
        engine.add_request(input_ids=p, params=greedy(30))
    # The CPU attention backend and the draft loop's emulation read host data a GPU's graphs never ask for.
    emulation = ("hyperdraft/attention/torch_backend.py", "hyperdraft/speculative/drafting/graphs.py")
    per_step = reads_per_step(engine, emulation)
    assert engine.worker.verify_ahead.used > 0
    assert_one_read_per_step(per_step)


@pytest.mark.parametrize("page_size", [1, 4])
def test_next_round_batch_equals_the_batch_of_the_true_counts(page_size):
    """The batch queued before the accept counts reach the host (this round's verify batch moved on by a + 1)
    equals, on every device field a forward reads, the batch built once they are known: rows [bonus, drafts] at
    n + a + 1 onwards; and so does a queued batch moved on again (a round served by a queued verify queues the
    next)."""
    torch.manual_seed(0)
    table = PageTable(num_pages=64, page_size=page_size, max_rows=4, max_pages_per_row=64 // page_size,
                      device=torch.device("cpu"))
    k = 3
    reqs = []
    for row, n in enumerate([5, 17, 2]):
        req = Request(f"r{row}", list(range(n + 1)), SamplingParams(max_new_tokens=50), seed=0)
        req.row, req.num_computed = table.acquire_row(), n
        assert table.reserve(req.row, n + k + 1)
        reqs.append(req)
    fb = build_forward_batch(ForwardMode.TARGET_VERIFY, [ForwardInput(r.row, r.num_computed, [0] * (k + 1), k + 1)
                                                         for r in reqs], table, torch.device("cpu"),
                             input_ids=torch.zeros(3 * (k + 1), dtype=torch.int64))
    for num_accepted in (torch.tensor([0, 3, 1]), torch.tensor([2, 0, 3])):
        tokens = torch.randint(0, 100, (3, k + 1))
        drafts = torch.randint(0, 100, (3, k))
        fb = next_round_batch(fb, reqs, num_accepted, tokens, Proposal(drafts, [k] * 3), table)
        assert all(table.num_slots(r.row) >= r.num_computed + 2 * (k + 1) for r in reqs), "room not reserved"
        for r, a in zip(reqs, num_accepted.tolist()):  # the commit the host makes once the counts arrive
            r.num_computed += a + 1
        inputs = [ForwardInput(r.row, r.num_computed, [0] * (k + 1), k + 1) for r in reqs]
        ids = torch.cat([tokens[torch.arange(3), num_accepted][:, None], drafts], 1).flatten()
        ref = build_forward_batch(ForwardMode.TARGET_VERIFY, inputs, table, torch.device("cpu"), input_ids=ids)
        for field in ("input_ids", "positions", "out_slots", "req_rows", "seq_lens_t", "extend_starts_t",
                      "extend_lens_t", "logits_indices"):
            assert torch.equal(getattr(fb, field), getattr(ref, field)), field
        assert fb.max_seq_len >= ref.max_seq_len and all(p >= q for p, q in zip(fb.prefix_lens, ref.prefix_lens))


@pytest.mark.parametrize("name", ["eagle3", "eagle3-tree", "standalone"])
def test_one_page_table_write_per_drafted_step(models, llm_factory, monkeypatch, name):
    """A drafted round that drafts ahead reserves the next round's room (draft and verify) before its first page-table
    read, so the commit's released pages, its own reads and the next round's room reach the device table in one write
    a step (each write is a pinned copy and a launch on the host), even at page size 1 where every step takes pages."""
    path, args = _args(models, name, page_size=1)
    monkeypatch.setenv("HYPERDRAFT_EMULATE_CUDA_GRAPH", "1")
    llm = llm_factory(path, cuda_graph_max_bs=4, **args)
    engine = llm.engine
    for p in _prompts(name)[:3]:
        engine.add_request(input_ids=p, params=greedy(30))
    writes, flush = [0], PageTable.flush

    def counted(table):
        writes[0] += bool(table._pending)
        return flush(table)

    monkeypatch.setattr(PageTable, "flush", counted)
    per_step = []
    while engine.has_unfinished():
        writes[0] = 0
        decoding = all(r.num_computed >= len(r.prompt_ids) for r in engine.scheduler.running)
        engine.step()
        if decoding:
            per_step.append(writes[0])
    assert engine.worker.verify_ahead.used > 0 and len(per_step) > 10
    assert max(per_step) == 1, per_step
