"""The greedy shortcuts of the spec step return exactly what the general rules return when every target row is
one-hot (greedy requests) and the drafts are deterministic: verify_greedy_tree vs verify_tree, verify_greedy_chain
vs verify_chain, simulate_chain / simulate_tree with greedy_target vs with p, and probs_from_logits for an all-greedy
batch vs its general path. The engine then never builds p for such batches."""

from __future__ import annotations

import pytest
import torch

from hyperdraft import SamplingParams
from hyperdraft.sample.logits_ops import SamplingBatch, probs_from_logits
from hyperdraft.sample.rng import DOMAIN_ACCEPT, uniform
from hyperdraft.speculative.verify.rejection import verify_chain, verify_greedy_chain
from hyperdraft.speculative.verify.simulated import simulate_chain, simulate_tree
from hyperdraft.speculative.verify.tree_buffers import build_tree
from hyperdraft.speculative.verify.tree_rejection import verify_greedy_tree, verify_tree


def _random_trees(seed: int, b: int = 800, n: int = 12, vocab: int = 4):
    g = torch.Generator().manual_seed(seed)
    parents = torch.full((b, n), -1)
    for i in range(1, n):
        parents[:, i] = (torch.rand(b, generator=g) * min(i, 4)).long()  # bushy: up to 4 children, duplicates
    tokens = torch.randint(0, vocab, (b, n), generator=g)
    num_nodes = torch.randint(1, n + 1, (b,), generator=g)
    tree = build_tree(tokens, parents, num_nodes=num_nodes, validate=True)
    argmax = torch.randint(0, vocab, (b, n), generator=g)
    p = torch.zeros(b, n, vocab).scatter_(2, argmax[..., None], 1.0)
    return tree, argmax, p, torch.arange(b), torch.randint(0, 1000, (b,), generator=g)


@pytest.mark.parametrize("max_depth", [1, 3, 11])
def test_greedy_tree_equals_general_rule(max_depth):
    tree, argmax, p, seeds, positions = _random_trees(max_depth)
    general = verify_tree(p, tree, seeds, positions, False, max_depth=max_depth, max_children=tree.num_children().max().item())
    fast = verify_greedy_tree(argmax, tree, max_depth=max_depth)
    for a, b in zip(general, fast):
        assert torch.equal(a, b)
    assert len(set(general[0].tolist())) >= min(max_depth + 1, 3)  # several accept counts occur


@pytest.mark.parametrize("k", [0, 1, 4])
def test_greedy_chain_equals_general_rule(k):
    g = torch.Generator().manual_seed(k)
    n, vocab = 400, 5
    target = torch.randint(0, vocab, (n, k + 1), generator=g)
    p = torch.nn.functional.one_hot(target, vocab).float()
    draft = torch.where(torch.rand(n, k, generator=g) < 0.7, target[:, :k], torch.randint(0, vocab, (n, k), generator=g))
    lens = torch.randint(0, k + 1, (n,), generator=g)
    seeds, positions = torch.arange(n), torch.randint(0, 1000, (n,), generator=g)
    general = verify_chain(p, draft, lens, None, seeds, positions)
    fast = verify_greedy_chain(target, draft, lens)
    assert torch.equal(general[0], fast[0]) and torch.equal(general[1], fast[1])
    sim = simulate_chain(p, draft, lens, 0.6, seeds, positions)
    sim_fast = simulate_chain(None, draft, lens, 0.6, seeds, positions, greedy_target=target)
    assert torch.equal(sim[0], sim_fast[0]) and torch.equal(sim[1], sim_fast[1])


def test_simulated_tree_greedy_target_equals_p():
    tree, argmax, p, seeds, positions = _random_trees(5)
    general = simulate_tree(p, tree, 0.7, seeds, positions, max_depth=4)
    fast = simulate_tree(None, tree, 0.7, seeds, positions, max_depth=4, greedy_target=argmax)
    for a, b in zip(general, fast):
        assert torch.equal(a, b)


def test_all_greedy_probs_equal_general_path():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    params = [SamplingParams(temperature=0), SamplingParams(top_k=1, top_p=0.5)] * 3
    sb = SamplingBatch.build(params, [0] * 6, [0] * 6, 50, "cpu")
    assert sb.all_greedy
    general = probs_from_logits(logits, SamplingBatch(**{**sb.__dict__, "all_greedy": False}))
    assert torch.equal(probs_from_logits(logits, sb), general)


def test_simulated_tree_siblings_follow_their_rank_rates():
    """A root with 4 children: the walk's first step lands on the child of rank r with probability
    (1 - alpha)(1 - s)^(r - 1) s for r >= 1 and alpha for r = 0; none with (1 - alpha)(1 - s)^3. Without a sibling rate only
    rank 0 is ever taken (the chain-like model, bit for bit the old walk). 20000 rows, each count within 5.5 binomial
    standard deviations: a false failure has probability below 1e-6 (5 counts, each 3.8e-8 two-sided)."""
    rows, alpha, s = 20000, 0.6, 0.3
    parents = torch.tensor([[-1, 0, 0, 0, 0]]).repeat(rows, 1)
    tree = build_tree(torch.zeros(rows, 5, dtype=torch.int64), parents, validate=True)
    argmax = torch.zeros(rows, 5, dtype=torch.int64)
    seeds, positions = torch.arange(rows) * 7919 + 11, torch.full((rows,), 40)
    _, path, _ = simulate_tree(None, tree, alpha, seeds, positions, max_depth=1, greedy_target=argmax,
                               sibling_rate=s, max_children=4)
    want = [alpha] + [(1 - alpha) * (1 - s) ** (r - 1) * s for r in range(1, 4)] + [(1 - alpha) * (1 - s) ** 3]
    got = [(path[:, 1] == node).sum().item() for node in (1, 2, 3, 4, -1)]
    for count, prob in zip(got, want):
        assert abs(count - rows * prob) <= 5.5 * (rows * prob * (1 - prob)) ** 0.5, (got, [rows * w for w in want])
    plain = simulate_tree(None, tree, alpha, seeds, positions, max_depth=1, greedy_target=argmax, max_children=4)
    assert set(plain[1][:, 1].tolist()) == {1, -1}
    old_rule = torch.where(uniform(seeds, positions, DOMAIN_ACCEPT)[:, 0] < alpha, 1, -1)
    assert torch.equal(plain[1][:, 1], old_rule)
