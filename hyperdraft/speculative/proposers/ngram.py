"""NgramProposer: prompt lookup. No model: the draft is what followed the most recent earlier occurrence of
the sequence's own suffix (longest suffix first, from max_window down to min_window).

With a history (history_tokens > 0), the sequences of finished requests are kept too (the newest
history_tokens tokens of them), and a request whose own sequence has no match as long as the history's longest
one drafts from the history instead: chat answers share phrasing ("Here are some", "I hope this helps"), so
earlier answers predict later ones. Drafts only decide what gets verified, so this never changes outputs.

Draft-ahead (capabilities.drafts_ahead, where the target runs CUDA graphs and RuntimeOptions.draft_ahead allows):
right after a chain round's accept is queued, the next round's lookup is queued on the device from the round's
accepted tokens (kernels/ngram.py over ngram_store.DeviceSequences), so the round's verify can be queued too
(verify_ahead.py) and the GPU never waits for the host's lookup. The host does not learn the drafts' lengths before
the round's results, so such a round verifies K rows a request (as SGLang's NGRAM always verifies its fixed
draft-token count), accepting within each request's real count (Proposal.device_lens), which the round's results
bring back. A round whose lookups found nothing anywhere keeps what was queued behind it (speculative/worker.py;
RuntimeOptions.ahead_after_empty), so once a round drafts the lookups stay on the device until the batch changes; a
step that looks up on the host (the first after prefills or a changed batch) with no match anywhere still runs as a
plain decode step.
"""

from __future__ import annotations

import numpy as np
import torch

from hyperdraft.core.host_copy import host_to_device
from hyperdraft.kernels.ngram import SEPARATOR
from hyperdraft.request import Request, same_requests
from hyperdraft.runner.graph_runner import GraphRunner
from hyperdraft.speculative.adaptive.tier import Tier
from hyperdraft.speculative.graph_plan import verify_graph_runs
from hyperdraft.speculative.config import NgramTrie
from hyperdraft.speculative.proposal import Proposal, TreeProposal
from hyperdraft.speculative.proposer import Proposer, ProposerCapabilities, ProposerContext
from hyperdraft.speculative.proposers.ngram_store import DeviceSequences
from hyperdraft.speculative.proposers.ngram_tree import TrieCorpus, TrieTreeShape, trie_tree

HISTORY_TOKENS = 1 << 16  # finished requests' tokens kept for matching (512 KiB)


# Candidates still matching after this many positions (a long match: code, repeated text) are scored over the rest
# of the window in one pass, when that is at most ONE_PASS_PAIRS comparisons. Most lookups end within a step or two
# (a chat's suffix rarely recurs), where the step-by-step extension's few NumPy calls are cheapest: scoring every
# candidate over the whole window from the start measured 1.6-2x slower on Zipf-distributed text.
ONE_PASS_FROM = 5
ONE_PASS_PAIRS = 512


def longest_match(haystack: np.ndarray, suffix: np.ndarray, max_window: int) -> tuple[int, int]:
    """-> (w, e): the longest w <= max_window with haystack[e - w : e] == suffix[-w:] and e < len(haystack) (so a
    continuation exists), the latest such e; (0, 0) when the last token never occurs. Candidates are the places
    that match the last token, extended backwards together, and each step keeps only those that still match: one
    pass over the haystack, then work that shrinks with the survivors. (Scoring every candidate over the whole window
    cost 1-5 ms a request per round for a common last token in a full 64k-token history: thousands of candidates.)
    Survivors of ONE_PASS_FROM steps take the rest of the window at once."""
    ends = np.flatnonzero(haystack[:-1] == suffix[-1]) + 1  # ascending: the last survivor is the latest
    if not len(ends):
        return 0, 0
    window = min(max_window, len(suffix))
    length = 1
    for j in range(1, window):
        if j >= ONE_PASS_FROM and len(ends) * (window - j) <= ONE_PASS_PAIRS:
            rest = np.arange(j, window)
            at = ends[:, None] - 1 - rest  # [survivors, rest]: haystack index of suffix[-1 - j'] for each
            same = (at >= 0) & (haystack[np.maximum(at, 0)] == suffix[-1 - rest])
            run = np.where(same.all(1), len(rest), same.argmin(1))  # each survivor's further leading matches
            best = int(run.max())
            return length + best, int(ends[run == best][-1])
        at = ends - 1 - j  # haystack index of suffix[-1 - j] for each candidate
        keep = (at >= 0) & (haystack[np.maximum(at, 0)] == suffix[-1 - j])
        if not keep.any():
            break
        ends, length = ends[keep], j + 1
    return length, int(ends[-1])


def ngram_match(tokens: np.ndarray, k: int, min_window: int, max_window: int,
                history: np.ndarray | None = None) -> np.ndarray:
    """tokens: the whole sequence -> up to k tokens that followed the latest earlier match of its longest suffix
    (min_window..max_window tokens) in the sequence itself, or in the history when the history holds a strictly
    longer match."""
    w, e = longest_match(tokens, tokens, max_window)  # e < len(tokens): the suffix never matches itself
    source = tokens
    if history is not None and len(history) > 1:
        hw, he = longest_match(history, tokens, max_window)
        if hw > w:
            w, e, source = hw, he, history
    if w < min_window:
        return tokens[:0]
    draft = source[e : e + k]
    cut = np.flatnonzero(draft == SEPARATOR)
    return draft[: cut[0]] if len(cut) else draft


class NgramHistory:
    """The newest `capacity` tokens of finished requests' sequences, SEPARATOR between them."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.tokens = np.zeros(0, dtype=np.int64)

    def add(self, seq: list[int]) -> None:
        self.tokens = np.concatenate([self.tokens, np.asarray(seq, dtype=np.int64), [SEPARATOR]])[-self.capacity:]


class NgramProposer(Proposer):
    """No model, no K/V, no graphs: extend and commit have nothing to keep in step."""

    @classmethod
    def build(cls, ctx: ProposerContext, draft: None) -> "NgramProposer":
        spec = ctx.spec
        graphs = ctx.target.graphs
        # The trie tree is looked up on the host only (as SGLang's): draft-ahead queues the chain's device lookup.
        ahead = DeviceSequences(ctx.target.page_table, HISTORY_TOKENS, spec.ngram_min_window, spec.ngram_max_window) \
            if graphs is not None and ctx.options.draft_ahead and spec.ngram_trie is None else None
        return cls(spec.ngram_min_window, spec.ngram_max_window, ctx.target.device, ahead=ahead, verify_graphs=graphs,
                   trie=spec.ngram_trie)

    def __init__(self, min_window: int, max_window: int, device: torch.device, history_tokens: int = HISTORY_TOKENS,
                 ahead: DeviceSequences | None = None, verify_graphs: GraphRunner | None = None,
                 trie: NgramTrie | None = None):
        """ahead: where the device lookup keeps sequences (None: no draft-ahead); verify_graphs: the target's, which
        must run a batch's verify for it to be drafted ahead; trie: draft SGLang 0.5.23's trie tree (ngram_tree.py)
        instead of the prompt-lookup chain."""
        self.min_window, self.max_window, self.device, self.trie = min_window, max_window, device, trie
        self.capabilities = ProposerCapabilities(idle_at_step_zero=True, may_draft_nothing=True,
                                                 drafts_ahead=ahead is not None and verify_graphs is not None)
        self.pool = None
        self.history = NgramHistory(history_tokens) if history_tokens > 0 else None
        self.sequences_on_device, self.verify_graphs = ahead, verify_graphs
        self.ahead: tuple[list[Request], Tier, Proposal] | None = None  # the next round's draft, queued
        self.ahead_used = 0  # rounds served by a queued draft, and queued drafts thrown away (tests, benchmarks)
        self.ahead_discarded = 0
        self.live: dict[str, Request] = {}  # requests drafted for and not yet finished
        # Each live request's tokens as an int64 array that grows with its outputs, and how many it holds: converting
        # the whole token list every round cost 20-150 us a request at 1k-4k tokens, more than the lookup itself.
        self.sequences: dict[str, tuple[Request, np.ndarray, int]] = {}
        self.trie_corpus = TrieCorpus()

    def propose(self, reqs: list[Request], tier: Tier, sampling) -> Proposal | TreeProposal:
        steps = tier.steps
        self._collect_finished(reqs)
        queued = self._take_ahead(reqs, tier)
        if queued is not None:
            return queued
        if steps == 0:  # adaptive step 0: no speculation, and no drafter state to keep warm
            return Proposal(torch.zeros(len(reqs), 0, dtype=torch.int64, device=self.device), [0] * len(reqs))
        if self.trie is not None:
            return self._propose_trie(reqs, tier)
        history = self.history.tokens if self.history is not None else None
        drafts = [ngram_match(self._sequence(r), steps, self.min_window, self.max_window, history) for r in reqs]
        padded = np.zeros((len(reqs), steps), dtype=np.int64)
        for b, d in enumerate(drafts):
            padded[b, : len(d)] = d
        return Proposal(host_to_device(torch.from_numpy(padded), self.device), [len(d) for d in drafts])

    def _propose_trie(self, reqs: list[Request], tier: Tier) -> Proposal | TreeProposal:
        """Each request's trie tree (ngram_tree.py) over the history and its own tokens; a breadth of one drafts
        a chain."""
        shape = TrieTreeShape(tier.num_draft_tokens, tier.topk, self.trie.min_breadth, self.trie.max_trie_depth,
                              self.trie.match_type)
        history = self.history.tokens if self.history is not None else np.zeros(0, dtype=np.int64)
        n = tier.num_draft_tokens
        tokens, parents = np.zeros((len(reqs), n), dtype=np.int64), np.full((len(reqs), n), -1, dtype=np.int64)
        counts = []
        for b, req in enumerate(reqs):
            seq = self._sequence(req)
            corpus, first = self.trie_corpus.corpus(history, seq)
            node_tokens, node_parents = trie_tree(corpus, seq, shape, first)
            tokens[b, : len(node_tokens)], parents[b, : len(node_parents)] = node_tokens, node_parents
            counts.append(len(node_tokens))
        if not tier.is_tree:  # breadth 1: node i's parent is node i - 1
            return Proposal(host_to_device(torch.from_numpy(tokens[:, 1:]), self.device), [c - 1 for c in counts])
        tokens_d, parents_d = host_to_device(torch.from_numpy(np.stack([tokens, parents])), self.device)
        fed = torch.full_like(tokens_d, -1)  # no draft K/V
        return TreeProposal(tokens_d, parents_d, fed, num_nodes=counts)

    def draft_ahead(self, reqs: list[Request], tier: Tier, sampling, num_accepted: torch.Tensor, tokens: torch.Tensor,
                    kept: torch.Tensor | None = None) -> Proposal | None:
        """Queue the next chain round's lookup from this round's accepted tokens (module doc) -> its proposal, which
        the next propose() returns if that round has the same requests and tier."""
        self.discard_ahead()
        # Only where a verify graph runs the batch: it feeds every request the full width anyway, while an eager
        # verify would feed K rows a request where the host's lookup found fewer.
        if self.ahead_room(tier, len(reqs)) is None or not verify_graph_runs(self.verify_graphs, tier, len(reqs)):
            return None
        history = self.history.tokens if self.history is not None else None
        drafts = self.sequences_on_device.draft_ahead(reqs, num_accepted, tokens, tier.steps, history)
        proposal = Proposal(drafts.tokens, [tier.steps] * len(reqs), device_lens=drafts.lens)
        self.ahead = (list(reqs), tier, proposal)
        return proposal

    def ahead_room(self, tier: Tier, batch_size: int) -> int | None:
        """A lookup writes no K/V: 0 past the verify's own room for the chain tiers it drafts ahead."""
        return 0 if self.capabilities.drafts_ahead and tier.steps > 0 and not tier.is_tree else None

    def discard_ahead(self) -> None:
        if self.sequences_on_device is not None:
            self.sequences_on_device.settle()
        self.ahead_discarded += self.ahead is not None
        self.ahead = None

    def _take_ahead(self, reqs: list[Request], tier: Tier) -> Proposal | None:
        if self.sequences_on_device is not None:
            self.sequences_on_device.settle()
        ahead, self.ahead = self.ahead, None
        if ahead is None:
            return None
        queued_reqs, queued_tier, proposal = ahead
        if queued_tier != tier or not same_requests(reqs, queued_reqs):
            self.ahead_discarded += 1
            return None
        self.ahead_used += 1
        return proposal

    def _sequence(self, req: Request) -> np.ndarray:
        """req's tokens, appending only those added since its last round to its array (grown by doubling)."""
        n = req.seq_len
        owner, buf, filled = self.sequences.get(req.rid, (req, np.empty(0, dtype=np.int64), 0))
        if owner is not req:  # a finished request's id, reused
            buf, filled = np.empty(0, dtype=np.int64), 0
        filled = min(filled, n)  # outputs only grow while a request runs; a shorter one is refilled from there
        if buf.shape[0] < n:
            grown = np.empty(max(n, 2 * buf.shape[0]), dtype=np.int64)
            grown[:filled] = buf[:filled]
            buf = grown
        buf[filled:n] = req.token_ids(filled, n)
        self.sequences[req.rid] = (req, buf, n)
        return buf[:n]

    def _collect_finished(self, reqs: list[Request]) -> None:
        """Finished requests' sequences join the history (noticed lazily: at the next propose after they finish), and
        their arrays go."""
        for rid, req in list(self.live.items()):
            if req.finished:
                if self.history is not None:
                    self.history.add(req.prompt_ids + req.output_ids)
                del self.live[rid]
        self.live.update((r.rid, r) for r in reqs)
        for rid in self.sequences.keys() - self.live.keys():
            del self.sequences[rid]
        if self.sequences_on_device is not None:
            self.sequences_on_device.forget(self.live.keys())

    def flush_history(self) -> None:
        if self.history is not None:
            self.history.tokens = self.history.tokens[:0]
        self.live.clear()
        self.sequences.clear()

    def save_history(self) -> tuple:
        """The history as it stands, including finished requests not yet collected (for benchmarks that repeat a
        prompt: a repeat must not find its own earlier answer)."""
        return (None if self.history is None else self.history.tokens.copy()), dict(self.live)

    def restore_history(self, saved: tuple) -> None:
        tokens, live = saved
        if self.history is not None:
            self.history.tokens = tokens.copy()
        self.live = dict(live)
