"""Acceptance through trees (STANDALONE, topk > 1) when the draft IS the target.

With num_draft_tokens = every candidate the beam produces + 1, the verify tree holds every candidate, so a greedy
verify walks down the greedy path for as long as the greedy child of the current node is a candidate. A node's
children are candidates only if the node was in the beam's frontier (expanded); with the draft equal to the target,
an expanded node's top-1 child is the greedy token. So every verify accepts the whole depth unless the beam dropped
a greedy-path node from its frontier (another branch had a higher cumulative draft log-probability): a genuine beam
drop, not a bug.

- sharpened: the tiny target with its final norm weight times 8 (logits x8; tied embeddings, so the lm_head itself
  is left alone): the softmax is peaked, the greedy path always has the best cumulative score, and every verify
  accepts all `steps` tokens (server info: histogram and acceptance by position; max_new_tokens truncation does not
  affect those counters).
- the unsharpened tiny target (nearly flat distributions): the beam does drop the greedy path. A spy on
  TreeRound.accept records every round's tree, and each verify must accept exactly the longest greedy prefix held
  by the tree, with every shortfall explained by a beam drop (the last accepted node was never expanded).
"""

from __future__ import annotations

import os
import shutil

import pytest

from hyperdraft import LLM
from hyperdraft.speculative.verify.tree import TreeRound
from helpers.spec_fixtures import _single_torch_thread, assert_clean, gen, greedy, llm_factory, mixed_prompts, spec_models  # noqa: F401

NEW_TOKENS = 20
# (topk, steps): num_draft_tokens = topk + (steps-1)*topk^2 + 1, every candidate plus the root
TREES = [(2, 3), (2, 5), (3, 4), (4, 3)]


def all_candidates(topk: int, steps: int) -> int:
    return topk + (steps - 1) * topk * topk + 1


@pytest.fixture(scope="module")
def sharpened(spec_models, tmp_path_factory) -> str:
    from safetensors.torch import load_file, save_file

    dst = str(tmp_path_factory.mktemp("sharpened") / "target_x8")
    shutil.copytree(spec_models["target"], dst)
    path = os.path.join(dst, "model.safetensors")
    tensors = load_file(path)
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * 8.0
    save_file(tensors, path, metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return mixed_prompts(8, seed=31)


class RoundSpy:
    def __init__(self, monkeypatch):
        self.records: list[dict] = []
        original = TreeRound.accept
        spy = self

        def accept(round_, *args, **kwargs):
            out = original(round_, *args, **kwargs)
            num_accepted = round_.num_accepted.tolist()
            prop = round_.proposal
            for b, r in enumerate(round_.reqs):
                spy.records.append(dict(req=r, base=r.num_computed, tokens=prop.tokens[b].tolist(),
                                        parents=prop.parents[b].tolist(), fed=prop.fed[b].tolist(),
                                        num_accepted=num_accepted[b]))
            return out

        monkeypatch.setattr(TreeRound, "accept", accept)


def show(rec: dict) -> dict:
    """A round record for failure messages (the request itself is too long to print)."""
    return {"rid": rec["req"].rid, **{k: v for k, v in rec.items() if k != "req"}}


def greedy_walk(rec: dict, continuation: list[int]) -> list[int]:
    """Nodes of the tree's longest prefix of the greedy continuation, root first."""
    path = [0]
    for tok in continuation:
        kids = [i for i in range(1, len(rec["tokens"])) if rec["parents"][i] == path[-1] and rec["tokens"][i] == tok]
        if not kids:
            break
        path.append(kids[0])
    return path


def run_with_spy(llm_factory, model, prompts, topk, steps, monkeypatch):
    """-> (outputs, server state, spy records, greedy continuations long enough for every round)."""
    ref_llm = LLM(model, device="cpu", dtype="float32", skip_tokenizer_init=True)
    refs = gen(ref_llm, prompts, greedy(NEW_TOKENS + steps + 1))
    assert_clean(ref_llm)
    spy = RoundSpy(monkeypatch)
    n = all_candidates(topk, steps)
    llm = llm_factory(model, skip_tokenizer_init=True, speculative_algorithm="STANDALONE",
                      speculative_draft_model_path=model, speculative_eagle_topk=topk, speculative_num_steps=steps,
                      speculative_num_draft_tokens=n)
    outs = gen(llm, prompts, greedy(NEW_TOKENS))
    for i, (o, r) in enumerate(zip(outs, refs)):
        assert o.token_ids == r.token_ids[:NEW_TOKENS], f"request {i}: spec output differs from spec-off"
    full = {o.meta_info["id"]: p + r.token_ids for o, p, r in zip(outs, prompts, refs)}
    state = llm.get_server_info()["internal_states"][0]
    return outs, state, spy.records, full


@pytest.mark.parametrize("topk,steps", TREES, ids=[f"topk{k}-steps{s}" for k, s in TREES])
def test_sharpened_self_draft_accepts_every_step(sharpened, llm_factory, prompts, topk, steps, monkeypatch):
    _, state, records, full = run_with_spy(llm_factory, sharpened, prompts, topk, steps, monkeypatch)
    assert records, "no tree verify ran"
    for rec in records:
        seq = full[rec["req"].rid]
        walk = greedy_walk(rec, seq[rec["base"] + 1 : rec["base"] + 1 + steps])
        assert len(walk) == steps + 1, f"the greedy path is not whole in the tree: {show(rec)}"
        assert rec["num_accepted"] == steps, show(rec)
    hist = state["spec_accept_length_histogram"]
    assert hist == [0] * (steps + 1) + [state["spec_verifies"]], hist
    assert state["spec_acceptance_by_position"] == [1.0] * steps
    assert state["avg_spec_accept_length"] == steps + 1
    assert state["spec_draft_tokens"] == (all_candidates(topk, steps) - 1) * state["spec_verifies"]


@pytest.mark.parametrize("topk,steps", [(2, 5), (3, 4)], ids=["topk2-steps5", "topk3-steps4"])
def test_self_draft_shortfalls_are_beam_drops(spec_models, llm_factory, prompts, topk, steps, monkeypatch):
    """The unsharpened target drafting for itself: every verify accepts exactly the greedy prefix the tree holds, and
    every round that stops short stops at a node the beam never expanded (its greedy child was never a candidate)."""
    _, state, records, full = run_with_spy(llm_factory, spec_models["target"], prompts, topk, steps, monkeypatch)
    drops = 0
    for rec in records:
        seq = full[rec["req"].rid]
        walk = greedy_walk(rec, seq[rec["base"] + 1 : rec["base"] + 1 + steps])
        assert rec["num_accepted"] == len(walk) - 1, f"verify accepted {rec['num_accepted']}, tree holds {walk}: {show(rec)}"
        if len(walk) <= steps:  # stopped short of the full depth
            last = walk[-1]
            assert rec["fed"][last] < 0, (f"node {last} was expanded, yet its greedy child {seq[rec['base'] + len(walk)]} "
                                          f"is not among its candidates (draft argmax != target argmax?): {show(rec)}")
            drops += 1
    # Top-1 of the root (node 1 is the best root child) is always the greedy token, so depth 1 is always accepted,
    # and with topk siblings of every expanded node, depth 2 too.
    assert state["spec_acceptance_by_position"][:2] == [1.0, 1.0], state
    assert drops > 0, "the beam never dropped the greedy path: this test checks nothing beyond the sharpened one"
