"""An EAGLE head parked at adaptive step 0 (speculative/proposers/slot_hidden.py), CPU fp32: step-0 steps run as the
plain worker's decodes, the head's inputs wait by slot, and the next round extends the head over them. Outputs never
change, and the head's K/V after unparking is the K/V the rounds path (park_head off) builds token by token."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from hyperdraft import LLM, SamplingParams
from hyperdraft.options import RuntimeOptions
from hyperdraft.testing.eagle_ckpt import write_random_eagle_checkpoint
from hyperdraft.testing.tiny import make_tiny_model
from tests.conftest import assert_engine_clean
from tests.helpers.spec_fixtures import STEP_ZERO_PARAMS

torch.set_num_threads(1)

PROMPTS = [[5, 6, 7] * 6, [9, 8] * 8, [1, 2, 3, 4] * 4, [20, 21] * 9]
LADDERS = {
    "zero_only": {"1": {"candidate_steps": [0]}},
    # 3, 0, 3, 0, ...: a huge down-hysteresis drops after every round, the probe climbs back: parks and unparks
    "zero_three": {"ema_alpha": 1.0, "warmup_batches": 0, "update_interval": 1,
                   "1": {"candidate_steps": [0, 3], "down_hysteresis": 10.0}},
    # by batch size: 3 or more requests decode plainly, fewer draft 2 (requests finishing move the batch across)
    "by_batch": {"1": {"candidate_steps": [2]}, "3": {"candidate_steps": [0]}},
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("parked")
    target = make_tiny_model(str(root / "target"), "llama", num_hidden_layers=4)
    head = write_random_eagle_checkpoint(str(root / "e3"), target, kind="eagle3", draft_vocab_size=200)
    configs = {}
    for name, ladder in LADDERS.items():
        configs[name] = root / f"{name}.json"
        configs[name].write_text(json.dumps(ladder))
    return {"target": target, "eagle3": head, "configs": configs}


def _llm(models, ladder: str | None, park: bool = True, ahead: bool = True, **args) -> LLM:
    options = RuntimeOptions(emulate_cuda_graphs=True, decode_ahead=ahead, park_head=park)
    spec = {} if ladder is None else dict(
        speculative_algorithm="EAGLE3", speculative_draft_model_path=models["eagle3"], speculative_adaptive=True,
        speculative_adaptive_config=str(models["configs"][ladder]), speculative_num_steps=0)
    return LLM(models["target"], device="cpu", dtype="float32", runtime_options=options, cuda_graph_max_bs=4, **spec,
               **args)


def _generate(llm: LLM, params: list[SamplingParams], prompts=PROMPTS) -> list[list[int]]:
    outs = llm.generate(input_ids=prompts, sampling_params=params, use_tqdm=False)
    assert_engine_clean(llm)
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("ladder", ["zero_only", "zero_three", "by_batch"])
@STEP_ZERO_PARAMS
def test_parked_step_zero_equals_plain(models, ladder, params):
    """Spec on (parked step 0, rounds between) equals spec off (greedy, penalised) and equals the same engine with the
    head kept in step by rounds (seeded sampling); requests finish at different steps (the batch changes); the pool
    ends free. Step-0 steps really ran as the plain worker's, its next decode queued ahead: used by the step-0 step
    after it, thrown away by a round."""
    batch_params = [dataclasses.replace(params, max_new_tokens=n) for n in [32, 12, 20, 32]]
    llm = _llm(models, ladder)
    outs = _generate(llm, batch_params)
    if params.temperature == 0:
        want = _generate(_llm(models, None), batch_params)
    else:
        want = _generate(_llm(models, ladder, park=False), batch_params)
    assert outs == want
    worker = llm.engine.worker
    tiers = llm.get_server_info()["internal_states"][0]["spec_steps_per_tier"]
    used, discarded = worker.plain.ahead_used, worker.plain.ahead_discarded
    assert (discarded > 5 and used == 0) if ladder == "zero_three" else used > 5, (used, discarded)
    assert tiers.get("0", 0) > 5 and (ladder == "zero_only") == (len(tiers) == 1), tiers


def _head_kv(engine, req) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's K and V at positions 0 .. draft_num_computed - 1 of a running request."""
    table = engine.page_table
    index = torch.arange(req.draft_num_computed)
    slots = table.token_slots(torch.full_like(index, req.row), index)
    pool = engine.worker.proposer.pool
    return pool.k[:, slots], pool.v[:, slots]


def test_unparked_head_kv_equals_the_rounds_path(models):
    """Two engines in lockstep, parking and not, greedy: after every step, each request the parking engine has caught
    up (not parked) holds the head K/V the rounds path holds at the same positions. Requests that were parked for
    many tokens and then drafted again (the batch shrank below 3) must be among those compared."""
    params = [SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True) for n in [30, 10, 16, 30]]
    parked, rounds = _llm(models, "by_batch").engine, _llm(models, "by_batch", park=False).engine
    for engine in (parked, rounds):
        for ids, p in zip(PROMPTS, params):
            engine.add_request(input_ids=ids, params=p)
    slot_hidden = parked.worker.proposer.slot_hidden
    longest_unparked = 0
    while parked.has_unfinished():
        parked.step()
        rounds.step()
        twins = {r.rid: r for r in rounds.scheduler.running}
        for req in parked.scheduler.running:
            twin = twins[req.rid]
            assert req.token_ids(0, req.seq_len) == twin.token_ids(0, twin.seq_len)
            if slot_hidden.is_parked(req) or req.draft_num_computed != twin.draft_num_computed:
                continue
            for mine, theirs in zip(_head_kv(parked, req), _head_kv(rounds, twin)):
                torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)
            longest_unparked = max(longest_unparked, req.draft_num_computed - len(req.prompt_ids))
    assert not rounds.has_unfinished()
    assert longest_unparked > 12, longest_unparked  # answers' positions consumed after a long parking


def test_parked_store_is_sized_from_the_head_and_counted_in_the_budget(models):
    """One row of the head's own hidden size per K/V slot, in the head's dtype, and only where step 0 may park (with
    park_head off there is no store); parked_bytes_per_slot, what the engine's memory budget adds to each K/V token's
    bytes, is exactly that row."""
    parked, rounds = _llm(models, "zero_only").engine, _llm(models, "zero_only", park=False).engine
    head = parked.worker.proposer.head
    states = parked.worker.proposer.slot_hidden.states
    assert states.shape == (parked.page_table.num_pages * parked.page_table.page_size, head.hidden_size)
    assert states.dtype == next(head.parameters()).dtype
    assert rounds.worker.proposer.slot_hidden is None and rounds.worker.proposer.decode_sink() is None
    row_bytes = head.hidden_size * states.element_size()
    assert type(parked.worker.proposer).parked_bytes_per_slot(head) == row_bytes


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_parked_answer_is_cached_and_its_head_rebuilt_on_a_hit(models, page_size):
    """Answers decoded parked are cached as far as the target's K/V (their pages past the head's marked headless), so
    a second turn hits as much of its history as with the head kept in step by rounds; its prefill extends the head
    over the states kept in the hit's slots, after which its head K/V equals the rounds path's, position for position.
    Both turns' outputs equal spec off, and the pool ends free."""
    greedy = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)
    llms = {"parked": _llm(models, "zero_only", page_size=page_size),
            "rounds": _llm(models, "zero_only", park=False, page_size=page_size)}
    answers = {name: llm.generate(input_ids=PROMPTS, sampling_params=greedy, use_tqdm=False)
               for name, llm in llms.items()}
    first = [o.token_ids for o in answers["parked"]]
    assert first == [o.token_ids for o in answers["rounds"]] == _generate(_llm(models, None), [greedy] * 4)
    cache = llms["parked"].engine.prefix_cache
    assert cache.headless, "no page was cached past a parked head"
    second = [p + a + [7, 8, 9] for p, a in zip(PROMPTS, first)]
    reqs = {name: [llm.engine.add_request(input_ids=p, params=greedy) for p in second] for name, llm in llms.items()}
    for llm in llms.values():
        llm.engine.step()  # every second turn's prefill
    headless_hits = 0
    for mine, theirs in zip(reqs["parked"], reqs["rounds"]):
        # the rounds path caches to its head's last catch-up, one short of the target's K/V; parked, to the target's
        history = len(mine.prompt_ids) - 3  # the first turn: its prompt and answer
        assert mine.cached_tokens >= theirs.cached_tokens >= history - 2 - (page_size - 1), \
            (mine.cached_tokens, theirs.cached_tokens, history)
        assert mine.draft_num_computed == theirs.draft_num_computed == len(mine.prompt_ids) - 1
        for a, b in zip(_head_kv(llms["parked"].engine, mine), _head_kv(llms["rounds"].engine, theirs)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        headless_hits += mine.cached_tokens > 0
    assert headless_hits == len(second)
    assert not cache.headless, "the hits' prefills wrote their heads' K/V into the shared pages: none is headless now"
    outs = {}
    for name, llm in llms.items():
        while llm.engine.has_unfinished():
            llm.engine.step()
        outs[name] = [r.output_ids for r in reqs[name]]
        assert_engine_clean(llm)
    assert outs["parked"] == outs["rounds"] == _generate(_llm(models, None), [greedy] * 4, second)
