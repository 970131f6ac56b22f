"""verify_chain is lossless: whatever the draft distribution q, the emitted tokens follow the target's p.

The target here is a fixed table p[j] (V=5 tokens, K=3 drafts, so K+1 rows; the rows differ and have zeros),
the same for all N rows of the batch, so token j of a row's output should be distributed as p[j] (given
that the row emits a token j at all, i.e. num_accepted >= j). Drafts are drawn from q with a seeded
torch.Generator; verify_chain gets seeds = arange(N), so every row uses its own random stream.

Statistics: a chi-square goodness-of-fit test per emitted position (K+1 = 4 per test), each at p-value threshold
1e-6 / 4 (Bonferroni), so each test's false-failure probability is at most 1e-6. Everything is seeded, so a test
that passes once passes always; the bound is the chance that the fixed seeds happen to be unlucky.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from hyperdraft.speculative.verify.rejection import verify_chain

V, K, N = 5, 3, 50_000
ALPHA = 1e-6  # per test
SEQ_LEN = 17

P = torch.tensor([
    [0.10, 0.40, 0.00, 0.30, 0.20],  # p_0
    [0.50, 0.05, 0.25, 0.00, 0.20],  # p_1
    [0.00, 0.00, 0.60, 0.30, 0.10],  # p_2
    [0.25, 0.25, 0.25, 0.15, 0.10],  # p_3: the bonus row
], dtype=torch.float32)

Q_CASES = {
    "q_equals_p": P[:K].clone(),
    "q_uniform": torch.full((K, V), 1.0 / V),
    # q = 0 on tokens p allows (never drafted there: the residual must supply them)
    "q_zero_where_p_positive": torch.tensor([[0.0, 0.7, 0.0, 0.3, 0.0],
                                             [1.0, 0.0, 0.0, 0.0, 0.0],
                                             [0.0, 0.0, 0.2, 0.8, 0.0]]),
    # q > 0 on tokens p forbids (such drafts must always be rejected)
    "q_positive_where_p_zero": torch.tensor([[0.10, 0.10, 0.60, 0.10, 0.10],
                                             [0.10, 0.10, 0.10, 0.60, 0.10],
                                             [0.45, 0.45, 0.05, 0.05, 0.00]]),
}


def _draw(q: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """[K, V] -> [n, K] drafts, column j drawn from q[j]."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.multinomial(q[j], n, replacement=True, generator=g) for j in range(q.shape[0])], 1)


def _run(draft: torch.Tensor, q: torch.Tensor | None, draft_len: torch.Tensor | None = None, p: torch.Tensor = P):
    n = draft.shape[0]
    lens = torch.full((n,), draft.shape[1], dtype=torch.int64) if draft_len is None else draft_len
    q_batch = None if q is None else q.expand(n, -1, -1).contiguous()
    return verify_chain(p.expand(n, -1, -1).contiguous(), draft, lens, q_batch, torch.arange(n, dtype=torch.int64),
                        torch.full((n,), SEQ_LEN, dtype=torch.int64))


def _emitted_token_pvalues(num_accepted, tokens, p=P) -> list[tuple[int, int, float]]:
    """Per output position j: (j, rows emitting it, chi-square p-value of its tokens against p[j]). Tokens outside
    p[j]'s support are a hard failure, not a statistic."""
    results = []
    for j in range(p.shape[0]):
        rows = num_accepted >= j
        n_j = int(rows.sum())
        counts = torch.bincount(tokens[rows, j], minlength=V).double()
        support = p[j] > 0
        assert counts[~support].sum() == 0, f"position {j}: emitted tokens with p = 0: {counts.tolist()}"
        pj = p[j][support].double()
        expected = n_j * pj / pj.sum()  # exact float64 sum, as scipy demands
        # The chi-square approximation needs enough mass in every cell; otherwise the test would be toothless.
        assert expected.min() >= 20, f"position {j}: too few rows ({n_j}) for a meaningful test"
        results.append((j, n_j, float(chisquare(counts[support].numpy(), expected.numpy()).pvalue)))
    return results


def _assert_lossless(num_accepted, tokens, p=P):
    results = _emitted_token_pvalues(num_accepted, tokens, p)
    threshold = ALPHA / len(results)
    for j, n_j, pvalue in results:
        assert pvalue > threshold, f"position {j} ({n_j} rows): tokens do not follow p[{j}] (chi-square p = {pvalue:.3g})"


def _assert_structure(num_accepted, tokens, draft, draft_len):
    assert num_accepted.dtype == torch.int64 and tokens.shape == (draft.shape[0], draft.shape[1] + 1)
    assert bool(((num_accepted >= 0) & (num_accepted <= draft_len)).all())
    idx = torch.arange(draft.shape[1])
    accepted = idx[None, :] < num_accepted[:, None]
    assert bool((tokens[:, :-1][accepted] == draft[accepted]).all()), "accepted positions must carry the drafts"


@pytest.mark.parametrize("case", list(Q_CASES))
def test_sampled_drafts_lossless(case):
    q = Q_CASES[case]
    draft = _draw(q, N, seed=1234)
    num_accepted, tokens = _run(draft, q)
    _assert_structure(num_accepted, tokens, draft, torch.full((N,), K))
    # Drafts p forbids are never accepted.
    p_of_draft = P[:K].expand(N, -1, -1).gather(2, draft[..., None])[..., 0]
    assert not bool(((p_of_draft == 0) & (torch.arange(K)[None] < num_accepted[:, None])).any())
    _assert_lossless(num_accepted, tokens)
    if case == "q_equals_p":
        # q == p: min(1, p/q) = 1 for every draft, so everything is accepted (the coins are < 1).
        assert bool((num_accepted == K).all())


@pytest.mark.parametrize("drafts", ["random", "fixed"])
def test_one_hot_drafts_lossless(drafts):
    """q=None: deterministic drafts (NGRAM, greedy draft model). Lossless for any draft tokens, fixed or random
    (random ones include drafts that p forbids); a chain of forbidden drafts is never accepted."""
    if drafts == "random":
        draft = torch.randint(0, V, (N, K), generator=torch.Generator().manual_seed(99))
    else:
        draft = torch.tensor([[1, 2, 3]]).expand(N, -1).contiguous()
    num_accepted, tokens = _run(draft, None)
    _assert_structure(num_accepted, tokens, draft, torch.full((N,), K))
    _assert_lossless(num_accepted, tokens)
    if drafts == "fixed":
        fixed_forbidden = torch.tensor([[2, 3, 0]]).expand(N, -1).contiguous()
        acc2, _ = _run(fixed_forbidden, None)
        assert bool((acc2 == 0).all()), "a draft with p = 0 must never be accepted"


def test_variable_draft_lengths_lossless():
    """Requests with fewer drafts than K (NGRAM finds short or no matches): padding is never accepted and the
    token after the last real draft comes from the right row of p (bonus row draft_len)."""
    g = torch.Generator().manual_seed(7)
    draft = _draw(P[:K], N, seed=8)  # drafts that often agree with p, so enough rows reach the bonus row
    draft_len = torch.randint(0, K + 1, (N,), generator=g)
    num_accepted, tokens = _run(draft, None, draft_len)
    _assert_structure(num_accepted, tokens, draft, draft_len)
    _assert_lossless(num_accepted, tokens)


def test_mixed_rows_in_one_batch_lossless():
    """Rows of one batch with different q's (and q = p for some): each row is verified against its own q."""
    cases = list(Q_CASES.values())
    per = N // len(cases)
    draft = torch.cat([_draw(q, per, seed=50 + i) for i, q in enumerate(cases)])
    q_rows = torch.cat([q.expand(per, -1, -1) for q in cases])
    n = draft.shape[0]
    num_accepted, tokens = verify_chain(P.expand(n, -1, -1).contiguous(), draft, torch.full((n,), K), q_rows.contiguous(),
                                        torch.arange(n) + 10**9, torch.full((n,), 3))
    _assert_lossless(num_accepted, tokens)


def test_harness_detects_a_lossy_verifier():
    """Power check of the statistics above: drafts drawn from a peaked q but verified as if they came from the
    uniform q is a wrong use of verify_chain and biases the output; the same chi-square tests must reject it.
    (Biased by construction: token 0 has p_0 = 0.1 but comes out with probability 0.4; a pass here would need a
    chi-square statistic in the thousands to land below its critical value: false-failure probability < 1e-6.)"""
    true_q = torch.tensor([[0.80, 0.05, 0.05, 0.05, 0.05]] * K)
    draft = _draw(true_q, N, seed=4321)
    num_accepted, tokens = _run(draft, torch.full((K, V), 1.0 / V))
    pvalues = [pv for _, _, pv in _emitted_token_pvalues(num_accepted, tokens)]
    assert pvalues[0] < ALPHA / len(pvalues), pvalues


@pytest.mark.parametrize("with_q", [False, True])
def test_greedy_one_hot_p_accepts_longest_matching_prefix(with_q):
    """Greedy rows have a one-hot p at the argmax. Whatever q is, verification accepts exactly the longest prefix of
    drafts equal to the argmaxes (up to draft_len), and the last token is the argmax at the first mismatch."""
    g = torch.Generator().manual_seed(5)
    n, vocab = 4000, 7
    argmax = torch.randint(0, vocab, (n, K + 1), generator=g)
    p = torch.zeros(n, K + 1, vocab).scatter_(2, argmax[..., None], 1.0)
    match = torch.randint(0, K + 1, (n,), generator=g)  # drafts equal the argmax for the first `match` positions
    wrong = (argmax[:, :K] + torch.randint(1, vocab, (n, K), generator=g)) % vocab
    idx = torch.arange(K)[None]
    draft = torch.where(idx < match[:, None], argmax[:, :K], wrong)
    draft_len = torch.randint(0, K + 1, (n,), generator=g)
    q = None
    if with_q:  # a random draft distribution that gives every draft token positive mass
        q = torch.rand(n, K, vocab, generator=g) + 0.05
        q = q / q.sum(-1, keepdim=True)
    num_accepted, tokens = verify_chain(p, draft, draft_len, q, torch.arange(n), torch.randint(0, 1000, (n,), generator=g))
    expected = torch.minimum(match, draft_len)
    assert torch.equal(num_accepted, expected)
    rows = torch.arange(n)
    assert torch.equal(tokens[rows, num_accepted], argmax[rows, num_accepted])
    assert bool((tokens[:, :K][idx < num_accepted[:, None]] == draft[idx < num_accepted[:, None]]).all())


def test_no_drafts_samples_from_p0():
    """K = 0 (no draft tokens at all): one token, drawn from p_0."""
    n = N
    p = P[:1].expand(n, -1, -1).contiguous()
    num_accepted, tokens = verify_chain(p, torch.zeros(n, 0, dtype=torch.int64), torch.zeros(n, dtype=torch.int64), None,
                                        torch.arange(n), torch.full((n,), 5))
    assert bool((num_accepted == 0).all()) and tokens.shape == (n, 1)
    _assert_lossless(num_accepted, tokens, P[:1])


def test_deterministic_given_seed_and_position():
    """Counter-based randomness: same (seed, position) -> same result; another position -> another draw."""
    draft = _draw(Q_CASES["q_uniform"], 2000, seed=3)
    q = Q_CASES["q_uniform"].expand(2000, -1, -1).contiguous()
    p = P.expand(2000, -1, -1).contiguous()
    lens = torch.full((2000,), K)
    a1, t1 = verify_chain(p, draft, lens, q, torch.arange(2000), torch.full((2000,), 40))
    a2, t2 = verify_chain(p, draft, lens, q, torch.arange(2000), torch.full((2000,), 40))
    a3, t3 = verify_chain(p, draft, lens, q, torch.arange(2000), torch.full((2000,), 41))
    assert torch.equal(a1, a2) and torch.equal(t1, t2)
    assert not (torch.equal(a1, a3) and torch.equal(t1, t3))
