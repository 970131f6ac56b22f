"""verify_tree: greedy exactness on hand-made trees, and losslessness of sampled tree verification.

Lossless means: conditioned on the walk reaching node v (path[depth(v)] == v), the token emitted after v is
distributed as p[v], whatever the draft tokens and q. The target here is a fixed table p[v] per node (V = 6, the
same for all rows of a group), the drafts are fixed (q None) or drawn from q with a seeded torch.Generator, and
verify_tree gets seeds = arange(rows), so every row has its own random stream.

Statistics: a chi-square goodness-of-fit test for every node v with enough rows reaching it, each at p-value
threshold 1e-6 / (number of nodes of the test's trees) (Bonferroni), so each test's false-failure probability is
at most 1e-6. Everything is seeded, so a test that passes once passes always; the bound is the chance that the
fixed seeds happen to be unlucky.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from hyperdraft.speculative.verify.tree_buffers import DraftTree, build_tree
from hyperdraft.speculative.verify.tree_rejection import verify_tree

V = 6
ALPHA = 1e-6  # per test
SEQ_LEN = 23

# Tree T: root children 1, 2, 3 (3 siblings); 4, 5 children of 1 (2 siblings); 6..9 children of 2 (4 siblings).
T_PARENTS = [-1, 0, 0, 0, 1, 1, 2, 2, 2, 2]
T_TOKENS = [9, 0, 2, 5, 1, 3, 0, 1, 4, 5]  # node 9's token 5 is one p[2] forbids
T_P = torch.tensor([
    [0.30, 0.05, 0.25, 0.10, 0.10, 0.20],  # p[0]
    [0.10, 0.35, 0.00, 0.25, 0.30, 0.00],  # p[1]
    [0.15, 0.05, 0.20, 0.30, 0.30, 0.00],  # p[2]
    [0.20, 0.20, 0.20, 0.20, 0.20, 0.00],  # p[3]: leaf, bonus row
    [0.05, 0.15, 0.30, 0.00, 0.25, 0.25],  # p[4] .. p[9]: leaves
    [0.40, 0.10, 0.10, 0.10, 0.10, 0.20],
    [0.00, 0.50, 0.10, 0.10, 0.10, 0.20],
    [0.16, 0.16, 0.17, 0.17, 0.17, 0.17],
    [0.30, 0.30, 0.10, 0.10, 0.10, 0.10],
    [0.10, 0.20, 0.30, 0.40, 0.00, 0.00],
])
# Tree U (7 real nodes, padded to 10): root children 1..4 (4 siblings), 5, 6 children of 2.
U_PARENTS = [-1, 0, 0, 0, 0, 2, 2, -1, -1, -1]
U_TOKENS = [9, 1, 2, 3, 4, 0, 2, 0, 0, 0]


def _verify(p, tree, without_replacement=True, seeds=None):
    b = p.shape[0]
    seeds = torch.arange(b) if seeds is None else seeds
    return verify_tree(p, tree, seeds, torch.full((b,), SEQ_LEN), without_replacement)


def _node_pvalues(tree: DraftTree, p: torch.Tensor, path, out, rows=None) -> list[tuple[int, int, float]]:
    """p: [N, V], the table of every row in `rows`. Per node v: (v, rows reaching v, chi-square p-value of the token
    emitted after v against p[v]). Tokens outside p[v]'s support are a hard failure, not a statistic; nodes reached
    by too few rows for the chi-square approximation (expected count < 20 in some cell) are skipped."""
    rows = torch.arange(path.shape[0]) if rows is None else rows
    results = []
    for v in range(p.shape[0]):
        d = int(tree.depth[rows[0], v])
        if tree.parents[rows[0], v] < 0 and v > 0:
            continue  # padding
        reach = rows[path[rows, d] == v]
        counts = torch.bincount(out[reach, d], minlength=V).double()
        support = p[v] > 0
        assert counts[~support].sum() == 0, f"node {v}: emitted tokens with p = 0: {counts.tolist()}"
        pv = p[v][support].double()
        expected = len(reach) * pv / pv.sum()
        if expected.min() < 20:
            continue
        results.append((v, len(reach), float(chisquare(counts[support].numpy(), expected.numpy()).pvalue)))
    return results


def _assert_structure(tree, num_accepted, path, out):
    b, w = path.shape
    rows = torch.arange(b)
    idx = torch.arange(w)[None]
    assert torch.equal((path >= 0).sum(1) - 1, num_accepted)
    assert bool((path[:, 0] == 0).all()) and bool((out[rows, num_accepted] >= 0).all())
    for d in range(1, w):  # accepted nodes are children of the previous path node and carry their tokens
        ok = path[:, d] >= 0
        assert bool((tree.parents[rows[ok], path[ok, d]] == path[ok, d - 1]).all())
        assert bool((out[ok, d - 1] == tree.tokens[rows[ok], path[ok, d]]).all())
    assert bool((out[idx > num_accepted[:, None]] == -1).all())


def _assert_lossless(results, n_nodes, must_test):
    tested = {v for v, _, _ in results}
    assert set(must_test) <= tested, f"too few rows reached nodes {set(must_test) - tested}"
    for v, n_v, pvalue in results:
        assert pvalue > ALPHA / n_nodes, f"node {v} ({n_v} rows): tokens do not follow p[{v}] (p = {pvalue:.3g})"


# ---------------------------------------------------------------------------------------------------- greedy

# Tree G: root children 1 (token 3), 2 (token 5); 3 child of 1 (token 4); 4 child of 2 (token 1); 5 child of 3
# (token 2). Rows: (argmax per node, expected path, expected tokens).
G_PARENTS, G_TOKENS = [-1, 0, 0, 1, 2, 3], [7, 3, 5, 4, 1, 2]
GREEDY_CASES = [
    ([5, 0, 7, 0, 0, 0], [0, 2, -1, -1], [5, 7]),  # match at the second sibling, then no match
    ([3, 4, 0, 6, 0, 0], [0, 1, 3, -1], [3, 4, 6]),  # two levels deep
    ([3, 4, 0, 2, 0, 1], [0, 1, 3, 5], [3, 4, 2, 1]),  # the whole depth, bonus at the leaf
    ([5, 0, 1, 0, 0, 0], [0, 2, 4, -1], [5, 1, 0]),  # down the second branch to its leaf, bonus there
    ([0, 4, 1, 2, 1, 1], [0, -1, -1, -1], [0]),  # no match at all
    ([4, 4, 1, 2, 1, 1], [0, -1, -1, -1], [4]),  # a grandchild's token does not count at depth 1
]


@pytest.mark.parametrize("mode", ["q_none", "q_without_replacement", "q_with_replacement"])
def test_greedy_hand_made_trees(mode):
    b, n = len(GREEDY_CASES), len(G_PARENTS)
    argmax = torch.tensor([c[0] for c in GREEDY_CASES])
    p = torch.zeros(b, n, 8).scatter_(2, argmax[..., None], 1.0)
    q = None
    if mode != "q_none":  # any q with mass on every draft token: greedy acceptance must not depend on it
        q = torch.rand(b, n, 8, generator=torch.Generator().manual_seed(1)) + 0.01
        q = q / q.sum(-1, keepdim=True)
    tree = build_tree(torch.tensor(G_TOKENS).expand(b, -1), torch.tensor(G_PARENTS).expand(b, -1), q=q, validate=True)
    num_accepted, path, out = _verify(p, tree, mode != "q_with_replacement", seeds=torch.arange(b) * 7919)
    for row, (_, exp_path, exp_tokens) in enumerate(GREEDY_CASES):
        assert path[row].tolist() == exp_path
        assert num_accepted[row] == len(exp_tokens) - 1
        assert out[row, : len(exp_tokens)].tolist() == exp_tokens
    _assert_structure(tree, num_accepted, path, out)


def test_greedy_duplicate_siblings_padding_and_root_only():
    """Duplicate sibling tokens: the first one is followed. Padding nodes (num_nodes) are never candidates, even
    when their junk token equals the argmax. A root-only tree emits the argmax at the root."""
    tokens = torch.tensor([[7, 3, 3, 1, 2], [7, 1, 2, 4, 4]])
    parents = torch.tensor([[-1, 0, 0, 2, 1], [-1, 0, 0, 1, 0]])
    argmax = torch.tensor([[3, 5, 2, 0, 0], [4, 1, 1, 1, 1]])
    p = torch.zeros(2, 5, 8).scatter_(2, argmax[..., None], 1.0)
    tree = build_tree(tokens, parents, num_nodes=torch.tensor([5, 3]), validate=True)
    num_accepted, path, out = _verify(p, tree)
    assert path.tolist() == [[0, 1, -1], [0, -1, -1]] and num_accepted.tolist() == [1, 0]
    assert out[0, :2].tolist() == [3, 5] and out[1, 0] == 4
    root = build_tree(torch.tensor([[5]]), torch.tensor([[-1]]))
    num_accepted, path, out = _verify(torch.eye(8)[None, [6]], root)
    assert num_accepted.tolist() == [0] and path.tolist() == [[0]] and out.tolist() == [[6]]


def test_greedy_random_trees_match_reference_walk():
    g = torch.Generator().manual_seed(3)
    b, n, vocab = 1500, 12, 5
    parents = torch.full((b, n), -1)
    for i in range(1, n):
        parents[:, i] = (torch.rand(b, generator=g) * min(i, 4)).long()  # shallow-ish, bushy trees
    tokens = torch.randint(0, vocab, (b, n), generator=g)
    num_nodes = torch.randint(1, n + 1, (b,), generator=g)
    argmax = torch.randint(0, vocab, (b, n), generator=g)
    p = torch.zeros(b, n, vocab).scatter_(2, argmax[..., None], 1.0)
    tree = build_tree(tokens, parents, num_nodes=num_nodes, validate=True)
    num_accepted, path, out = _verify(p, tree)
    _assert_structure(tree, num_accepted, path, out)
    par, tok, am = tree.parents.tolist(), tokens.tolist(), argmax.tolist()
    for r in range(b):
        v, walk = 0, [0]
        while True:
            kids = [c for c in range(n) if par[r][c] == v and tok[r][c] == am[r][v]]
            if not kids:
                break
            v = kids[0]
            walk.append(v)
        assert path[r, : len(walk)].tolist() == walk and int(num_accepted[r]) == len(walk) - 1
        assert out[r, : len(walk)].tolist() == [tok[r][c] for c in walk[1:]] + [am[r][v]]


# ---------------------------------------------------------------------------------------------------- lossless


def test_deterministic_children_lossless():
    """q None, two tree shapes in one batch: tree T (3, 2 and 4 siblings, depth 2) on even rows, tree U (4 root
    children, padded) on odd rows, with U's p table a permutation of T's."""
    n_rows = 120_000
    p_u = T_P[[3, 0, 2, 1, 9, 4, 8, 5, 6, 7]]
    tokens = torch.tensor([T_TOKENS, U_TOKENS]).repeat(n_rows // 2, 1)
    parents = torch.tensor([T_PARENTS, U_PARENTS]).repeat(n_rows // 2, 1)
    num_nodes = torch.tensor([10, 7]).repeat(n_rows // 2)
    tree = build_tree(tokens, parents, num_nodes=num_nodes, validate=True)
    p = torch.stack([T_P, p_u]).repeat(n_rows // 2, 1, 1)
    num_accepted, path, out = _verify(p, tree)
    _assert_structure(tree, num_accepted, path, out)
    even, odd = torch.arange(0, n_rows, 2), torch.arange(1, n_rows, 2)
    _assert_lossless(_node_pvalues(tree, T_P, path, out, even), 17, must_test=[0, 1, 2, 3, 4, 5, 7, 8])
    _assert_lossless(_node_pvalues(tree, p_u, path, out, odd), 17, must_test=[0, 1, 2, 3, 4, 5, 6])


# Real q: the root's 3 children are drawn without replacement from Q[0], node 1's 2 children from Q[1]; nodes 2, 3
# and node 1's children are leaves. Node numbering: 1, 2, 3 root children in draw order; 4, 5 children of 1.
Q_PARENTS = [-1, 0, 0, 0, 1, 1]
Q_P = T_P[[0, 1, 2, 3, 4, 5]]
Q_CASES = {
    "q_equals_p": Q_P.clone(),
    "q_uniform": torch.full((6, V), 1.0 / V),
    # q = 0 on tokens p allows and q > 0 on tokens p forbids; at least k nonzero entries per drawing row
    "q_mismatched_support": torch.tensor([[0.00, 0.30, 0.40, 0.10, 0.00, 0.20],
                                          [0.50, 0.00, 0.30, 0.00, 0.00, 0.20]] + [[1.0 / V] * V] * 4),
    "q_peaked": torch.tensor([[0.80, 0.05, 0.05, 0.04, 0.03, 0.03],
                              [0.02, 0.02, 0.06, 0.10, 0.10, 0.70]] + [[1.0 / V] * V] * 4),
}


def _draw_tree(q: torch.Tensor, n_rows: int, seed: int, without_replacement: bool) -> torch.Tensor:
    """-> [n_rows, 6] tokens of tree Q_PARENTS: children of node 0 (3) and node 1 (2) drawn from q[0], q[1] by
    Gumbel-top-k (= sequential sampling without replacement, in draw order), or independently."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.zeros(n_rows, 6, dtype=torch.int64)
    for v, kids in ((0, [1, 2, 3]), (1, [4, 5])):
        if without_replacement:
            gumbel = -torch.log(-torch.log(torch.rand(n_rows, V, generator=g).clamp_min(1e-20)))
            tokens[:, kids] = (q[v].log() + gumbel).topk(len(kids), dim=1).indices
        else:
            tokens[:, kids] = torch.multinomial(q[v], n_rows * len(kids), True, generator=g).view(n_rows, len(kids))
    return tokens


def _run_sampled(q_true, q_given, without_replacement, verify_without_replacement, n_rows=40_000, seed=11):
    tokens = _draw_tree(q_true, n_rows, seed, without_replacement)
    q_batch = None if q_given is None else q_given.expand(n_rows, -1, -1)
    tree = build_tree(tokens, torch.tensor(Q_PARENTS).expand(n_rows, -1), q=q_batch)
    num_accepted, path, out = _verify(Q_P.expand(n_rows, -1, -1), tree, verify_without_replacement)
    _assert_structure(tree, num_accepted, path, out)
    return _node_pvalues(tree, Q_P, path, out)


# Nodes every case must test: with q == p the first child is always accepted (r / q = 1); with the mismatched
# support the residual after one rejection lives on tokens q never draws, so later siblings are never accepted.
MUST_TEST = {"q_equals_p": [0, 1, 4], "q_uniform": [0, 1, 2, 3, 4, 5], "q_mismatched_support": [0, 1, 4],
             "q_peaked": [0, 1, 2, 3, 4, 5]}


@pytest.mark.parametrize("case", list(Q_CASES))
def test_sampled_without_replacement_lossless(case):
    q = Q_CASES[case]
    _assert_lossless(_run_sampled(q, q, True, True), 6, must_test=MUST_TEST[case])


@pytest.mark.parametrize("case", list(Q_CASES))
def test_sampled_with_replacement_lossless(case):
    """Children drawn independently from q (duplicate tokens possible), verified with sample_without_replacement
    False."""
    q = Q_CASES[case]
    _assert_lossless(_run_sampled(q, q, False, False), 6, must_test=MUST_TEST[case])


def test_sampled_children_verified_as_one_hot_lossless():
    """q None treats the children as fixed tokens; that is lossless for any children, however they were drawn (the
    drafts are independent of the verifier's coins), only less efficient than using q. So it is no negative
    control: it must pass."""
    _assert_lossless(_run_sampled(Q_CASES["q_peaked"], None, True, True), 6, must_test=[0, 1, 2, 3, 5])


@pytest.mark.parametrize("wrong", ["uniform_q", "with_replacement_rule", "independent_as_without_replacement"])
def test_harness_detects_a_lossy_verifier(wrong):
    """Power check of the statistics above: children drawn from the peaked q but verified with the wrong q (uniform)
    or the wrong rule (drawn without replacement, verified as independent draws, or the other way round) bias the
    root's output; the same chi-square test must reject it. At 40k rows these biases give chi-square statistics of
    about 59000, 3500 and 5800 against a critical value of about 40 (5 degrees of freedom, p = 1e-6 / 6): a false
    failure, i.e. such a statistic falling below 40, has probability far below 1e-6."""
    q = Q_CASES["q_peaked"]
    drawn_without, verified_without = {"uniform_q": (True, True), "with_replacement_rule": (True, False),
                                       "independent_as_without_replacement": (False, True)}[wrong]
    q_given = Q_CASES["q_uniform"] if wrong == "uniform_q" else q
    results = _run_sampled(q, q_given, drawn_without, verified_without)
    pvalue_root = [pv for v, _, pv in results if v == 0][0]
    assert pvalue_root < ALPHA / 6, results


def test_batch_independence_and_determinism():
    """A row's result depends only on its own seed, sequence index and inputs: permuting the batch permutes the
    results; another sequence index gives other draws."""
    n_rows = 3000
    q = Q_CASES["q_uniform"].expand(n_rows, -1, -1)
    tokens = _draw_tree(Q_CASES["q_uniform"], n_rows, 5, True)
    tree = build_tree(tokens, torch.tensor(Q_PARENTS).expand(n_rows, -1), q=q)
    p = Q_P.expand(n_rows, -1, -1)
    seeds = torch.arange(n_rows) * 31 + 5
    lens = torch.randint(0, 500, (n_rows,), generator=torch.Generator().manual_seed(2))
    a1, p1, t1 = verify_tree(p, tree, seeds, lens, True)
    perm = torch.randperm(n_rows, generator=torch.Generator().manual_seed(4))
    tree_perm = build_tree(tokens[perm], torch.tensor(Q_PARENTS).expand(n_rows, -1), q=q)
    a2, p2, t2 = verify_tree(p, tree_perm, seeds[perm], lens[perm], True)
    assert torch.equal(a1[perm], a2) and torch.equal(p1[perm], p2) and torch.equal(t1[perm], t2)
    a3, p3, t3 = verify_tree(p, tree, seeds, lens + 1, True)
    assert not (torch.equal(a1, a3) and torch.equal(t1, t3))
