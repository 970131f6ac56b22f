"""Lossless verification of draft trees: multi-candidate recursive rejection sampling.

Terms, for one request (see hyperdraft.speculative.verify.tree_buffers for node, parent, depth, children, q):
  p[v]       the target's sampling distribution for the token that follows node v (verify row v), after the
             request's penalties, temperature, top-k/top-p/min-p; greedy requests have a one-hot p at the argmax
  r          the distribution still to be matched at the current node: p[v], then residuals after rejections
  candidate  the children c_1, c_2, .. of the current node v, tried in sibling order (increasing node index)
  q_i        the distribution candidate i was drawn from:
               tree.q is None                      one-hot(token of c_i) (deterministic children)
               sample_without_replacement=True     q[v] with the tokens of c_1 .. c_{i-1} zeroed, renormalised
                                                   (the children were drawn without replacement: Gumbel-top-k)
               sample_without_replacement=False    q[v] (the children were drawn independently from q[v])
  accept     c_i is accepted iff u < min(1, r(c_i) / q_i(c_i)); u is a coin owned by (request, node c_i)
  residual   after rejecting c_i: r <- norm(max(0, r - q_i)); kept as r when it has no mass (then rejection had
             probability zero)
  accepted   the path root -> .. of accepted nodes: at each node the first accepted candidate is followed
  recovered  when every child of v is rejected, the token drawn from the final r (a residual)
  bonus      when v is a leaf, the token drawn from p[v]
Output = accepted nodes' tokens + one recovered-or-bonus token: 1 .. D+1 tokens (D = max depth).

Each level is the multi-draft speculative sampling of SpecInfer (independent candidates) or of Recursive
Speculative Decoding (candidates without replacement); both emit a token distributed exactly as r's initial
value p[v] whatever q is, and a walk of such levels follows the target's distribution.

Greedy requests (one-hot p at a) accept exactly the child whose token is a (the first such sibling), and the last
token is a at the last accepted node: token-for-token the output of plain greedy decoding.

Randomness is counter based (hyperdraft.sample.rng): the coin of candidate c is uniform(seed, seq_lens + depth(v),
DOMAIN_ACCEPT, width=N)[c] and the last token is sampled at position seq_lens + depth(last node) in DOMAIN_SAMPLE,
so a request's result does not depend on the rest of the batch.
"""

from __future__ import annotations

import torch

from hyperdraft.sample.rng import DOMAIN_ACCEPT, DOMAIN_SAMPLE, sample_from_probs, uniform
from hyperdraft.speculative.verify.tree_buffers import DraftTree

_TINY = 1e-30


def verify_tree(
    p: torch.Tensor,  # [B, N, V] target distribution of the token following each node
    tree: DraftTree,  # B requests, N node slots (tree.q: [B, N, V] or None)
    seeds: torch.Tensor,  # [B] int64
    seq_lens: torch.Tensor,  # [B] int64 sequence index of the token that follows the root
    sample_without_replacement: bool,
    max_depth: int | None = None,  # >= tree.depth.max(); given with max_children, verification needs no host sync
    max_children: int | None = None,  # >= children of any node
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (num_accepted [B] int64 accepted draft nodes, root not counted,
           path [B, D+1] int64 accepted node indices starting with the root 0, padded with -1,
           tokens [B, D+1] int64 accepted nodes' tokens then the recovered/bonus token at index num_accepted,
                  padded with -1);
    request b's output is tokens[b, :num_accepted[b] + 1]. D = max_depth (default: the batch's max depth)."""
    bsz, n, vocab = p.shape
    device = p.device
    if max_depth is None or max_children is None:
        depth_max, children_max = torch.stack([tree.depth.max(), tree.num_children().max()]).tolist()  # one sync
        max_depth = depth_max if max_depth is None else max_depth
        max_children = children_max if max_children is None else max_children
    rows = torch.arange(bsz, device=device)
    q_tree = tree.q

    cur = torch.zeros(bsz, dtype=torch.int64, device=device)  # current node of the walk
    done = torch.zeros(bsz, dtype=torch.bool, device=device)  # every child of the current node was rejected
    num_accepted = torch.zeros(bsz, dtype=torch.int64, device=device)
    path = torch.full((bsz, max_depth + 1), -1, dtype=torch.int64, device=device)
    path[:, 0] = 0
    out = torch.full((bsz, max_depth + 1), -1, dtype=torch.int64, device=device)
    final_r = torch.zeros(bsz, vocab, dtype=torch.float32, device=device)  # distribution of the last token

    for d in range(max_depth):
        r = p[rows, cur].float()  # [B, V]
        coins = uniform(seeds, seq_lens + d, DOMAIN_ACCEPT, width=n)  # [B, N]: one coin per candidate node
        cand = torch.where(done, -1, tree.first_child[rows, cur])  # [B] first candidate, -1 = none
        q_v = None if q_tree is None else q_tree[rows, cur].float()  # [B, V]
        chosen, r = _try_children(r, q_v, cand, coins, tree, max_children, sample_without_replacement)

        stop = ~done & (chosen < 0)  # no child accepted: the last token comes from r
        final_r = torch.where(stop[:, None], r, final_r)
        go = ~done & (chosen >= 0)
        chosen = chosen.clamp_min(0)
        num_accepted += go.long()
        path[:, d + 1] = torch.where(go, chosen, -1)
        out[:, d] = torch.where(go, tree.tokens[rows, chosen], out[:, d])
        cur = torch.where(go, chosen, cur)
        done |= stop

    final_r = torch.where(done[:, None], final_r, p[rows, cur].float())  # rows that reached depth max_depth: bonus
    out[rows, num_accepted] = sample_from_probs(final_r, seeds, seq_lens + num_accepted, DOMAIN_SAMPLE)
    return num_accepted, path, out


def _try_children(r: torch.Tensor, q_left: torch.Tensor | None, cand: torch.Tensor, coins: torch.Tensor,
                   tree: DraftTree, max_children: int, sample_without_replacement: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One level of the walk: try each request's candidates from `cand` on, in sibling order, until one is accepted.
    r [B, V]: the distribution to match; q_left [B, V]: q of the current node (None: one-hot children), whose tried
    tokens are zeroed when drawn without replacement; coins [B, N] -> (the accepted child [B], -1 where none, and r
    after the rejections [B, V])."""
    rows = torch.arange(cand.shape[0], device=cand.device)
    chosen = torch.full_like(cand, -1)
    for _ in range(max_children):
        trying = cand >= 0
        c = cand.clamp_min(0)
        tok = torch.where(trying, tree.tokens[rows, c], 0)  # [B]
        if q_left is None:
            q_i = torch.zeros_like(r).scatter_(1, tok[:, None], 1.0)
        elif sample_without_replacement:
            q_i = q_left / q_left.sum(-1, keepdim=True).clamp_min(_TINY)
        else:
            q_i = q_left
        q_c = q_i.gather(1, tok[:, None])[:, 0]
        r_c = r.gather(1, tok[:, None])[:, 0]
        u = coins.gather(1, c[:, None])[:, 0]
        # u < min(1, r/q) without division. The second term accepts outright when r(c) >= q(c): the same event
        # for u in (0, 1), and it keeps greedy exact even for a coin that rounds up to 1.0.
        accept = trying & ((u * q_c < r_c) | ((r_c >= q_c) & (r_c > 0)))
        if q_left is not None:
            # A candidate q gives no mass was not drawn from q (the draft ran out of support): accepting it
            # would be lossy. Rejecting it leaves r unchanged (q_i(c) = 0), as if it were not in the tree.
            accept &= q_c > 0
        reject = trying & ~accept
        residual = (r - q_i).clamp_min(0)
        mass = residual.sum(-1, keepdim=True)
        r = torch.where(reject[:, None] & (mass > 0), residual / mass.clamp_min(_TINY), r)
        if q_left is not None and sample_without_replacement:
            q_left = torch.where(reject[:, None], q_left.scatter(1, tok[:, None], 0.0), q_left)
        chosen = torch.where(accept, cand, chosen)
        cand = torch.where(reject, tree.next_sibling[rows, c], -1)
    return chosen, r


def verify_greedy_tree(target: torch.Tensor, tree: DraftTree, max_depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """verify_tree when every p is one-hot (greedy requests) and tree.q is None, from the argmax tokens alone.
    target: [B, N] int64, the argmax of each node's row. Same contract and result as verify_tree.

    With r one-hot at a = target[v] and one-hot candidates, a child is accepted exactly when its token is a
    (u * 1 < r(c) needs r(c) = 1; r(c) >= q(c) > 0 holds exactly then), and a rejection leaves r unchanged (r - q_i
    keeps the mass at a). So the walk follows, at every node, its first child in sibling order (increasing index)
    whose token is a, and the last token is a at the last accepted node: no coins, no vocabulary-wide work."""
    bsz, n = tree.tokens.shape
    device = tree.tokens.device
    # match_child[b, v]: the smallest child of v whose token is target[b, v]; n when none (parentless: dummy column n)
    has_parent = tree.parents >= 0
    parent = tree.parents.clamp_min(0)
    match = has_parent & (tree.tokens == target.gather(1, parent))
    slot = torch.where(match, parent, n)
    idx = torch.arange(n, device=device).expand(bsz, n)
    match_child = torch.full((bsz, n + 1), n, dtype=torch.int64, device=device)
    match_child.scatter_reduce_(1, slot, idx, reduce="amin", include_self=True)

    # The walk, without a loop over depths: a node is on the accepted path exactly when it and each of its ancestors
    # below the root is its parent's match child. Match children are unique per parent, so those nodes form one
    # chain from the root, one node per depth (20 ops where a depth loop took 8 per level; host_overhead
    # --alpha -1 --cases eagle3-tree).
    chosen = match & (match_child.gather(1, parent) == idx)
    chosen[:, 0] = True
    on_path = ~(tree.mask & ~chosen[:, None, :]).any(-1) & (tree.depth <= max_depth)  # [B, N]
    num_accepted = on_path.sum(-1) - 1
    at = torch.where(on_path, tree.depth, max_depth + 1)  # off-path nodes land in a dropped column
    path = torch.full((bsz, max_depth + 2), -1, dtype=torch.int64, device=device)
    path.scatter_(1, at, idx)
    path = path[:, : max_depth + 1]
    rows = torch.arange(bsz, device=device)
    cur = path[rows, num_accepted]
    out = torch.where(path[:, 1:] >= 0, tree.tokens.gather(1, path[:, 1:].clamp_min(0)), -1)
    out = torch.cat([out, out.new_full((bsz, 1), -1)], dim=1)
    out[rows, num_accepted] = target[rows, cur]
    return num_accepted, path, out
