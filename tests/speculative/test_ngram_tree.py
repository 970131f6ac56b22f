"""NGRAM's trie tree (SGLang 0.5.23's --speculative-ngram-match-type BFS / PROB): the occurrence-list builder equals
a literal trie that follows SGLang's description, and the engine's output with it equals plain decoding's."""

from __future__ import annotations

import heapq
import logging
from collections import deque

import numpy as np
import pytest

from hyperdraft.kernels.ngram import SEPARATOR
import hyperdraft.speculative.proposers.ngram_tree as ngram_tree
from hyperdraft.speculative.proposers.ngram_tree import TrieTreeShape, trie_tree


class ReferenceTrie:
    """Every n-gram of at most `depth` tokens of each inserted sequence, with a count and the clock of its latest
    insertion; children of a node are ranked by that recency (BFS) or by count, then token (PROB)."""

    def __init__(self, depth: int):
        self.depth, self.clock = depth, 0
        self.root = {"children": {}, "freq": 0, "touched": 0}

    def insert(self, seq: list[int]) -> None:
        for i in range(len(seq)):
            self.clock += 1
            node = self.root
            for token in seq[i:i + self.depth]:
                node = node["children"].setdefault(token, {"children": {}, "freq": 0, "touched": 0})
                node["freq"] += 1
                node["touched"] = self.clock

    def anchors(self, seq: list[int]) -> list[tuple[dict, int]]:
        """Nodes of seq's suffixes (1 .. depth tokens) that have children, longest first."""
        found = []
        for w in range(1, min(len(seq), self.depth) + 1):
            node = self.root
            for token in seq[len(seq) - w:]:
                node = node["children"].get(token)
                if node is None:
                    break
            if node is not None and node["children"]:
                found.append((node, w))
        return found[::-1]


def reference_tree(history: list[list[int]], seq: list[int], shape: TrieTreeShape) -> tuple[list[int], list[int]]:
    trie = ReferenceTrie(shape.max_trie_depth)
    for s in history + [seq]:
        trie.insert(s)
    tokens, parents, made, count = [seq[-1]], [-1], {}, [0]

    def add(parent: int, token: int):
        if (parent, token) in made:
            return made[(parent, token)]
        if len(tokens) >= shape.num_nodes or count[parent] >= shape.max_breadth:
            return None
        made[(parent, token)] = len(tokens)
        tokens.append(token), parents.append(parent), count.append(0)
        count[parent] += 1
        return len(tokens) - 1

    longest = max(1, shape.max_trie_depth - 1)
    scale = (shape.max_breadth - shape.min_breadth) / longest
    for anchor, w in trie.anchors(seq):
        if shape.match_type == "BFS":
            queue = deque([(0, (longest - w) * scale + shape.min_breadth, anchor)])
            while queue and len(tokens) < shape.num_nodes:
                parent, breadth, node = queue.popleft()
                ranked = sorted(node["children"].items(), key=lambda kv: -kv[1]["touched"])
                for token, child in ranked[: max(1, int(breadth))]:
                    at = add(parent, token)
                    if at is not None:
                        queue.append((at, breadth - scale, child))
                    if len(tokens) >= shape.num_nodes:
                        break
        else:
            heap, order = [], [0]

            def offer(parent, node, prob):
                ranked = sorted(node["children"].items(), key=lambda kv: (-kv[1]["freq"], kv[0]))[: shape.max_breadth]
                total = sum(c["freq"] for _, c in ranked)
                for token, child in ranked:
                    heapq.heappush(heap, (-(child["freq"] / total * prob), order[0], parent, token, child))
                    order[0] += 1

            offer(0, anchor, 1.0)
            while heap and len(tokens) < shape.num_nodes:
                neg, _, parent, token, child = heapq.heappop(heap)
                at = add(parent, token)
                if at is not None:
                    offer(at, child, -neg)
    return tokens, parents


def corpus_of(history: list[list[int]], seq: list[int]) -> np.ndarray:
    flat = [t for s in history for t in s + [SEPARATOR]]
    return np.asarray(flat + seq, dtype=np.int64)


@pytest.mark.parametrize("small_node", [0, 16, 10**9], ids=["numpy-grouping", "both", "python-grouping"])
@pytest.mark.parametrize("match_type", ["BFS", "PROB"])
def test_tree_equals_a_literal_trie_on_random_sequences(match_type, small_node, monkeypatch):
    monkeypatch.setattr(ngram_tree, "SMALL_NODE", small_node)
    rng = np.random.default_rng(1)
    for _ in range(600):
        vocab = int(rng.integers(2, 7))  # small vocabularies: deep tries and many merges
        seq = rng.integers(0, vocab, int(rng.integers(1, 50))).tolist()
        history = [rng.integers(0, vocab, int(rng.integers(1, 30))).tolist() for _ in range(int(rng.integers(0, 3)))]
        lo = int(rng.integers(1, 4))
        shape = TrieTreeShape(num_nodes=int(rng.integers(2, 20)), max_breadth=int(rng.integers(lo, 11)),
                              min_breadth=lo, max_trie_depth=int(rng.integers(2, 12)), match_type=match_type)
        want = reference_tree(history, seq, shape)
        got = trie_tree(corpus_of(history, seq), np.asarray(seq, dtype=np.int64), shape)
        assert got == want, (history, seq, shape)


def test_the_shared_corpus_buffer_and_history_places_give_the_same_trees():
    """TrieCorpus (one buffer for every request, each token's history places found once per history) against a fresh
    corpus and scan per call: requests of every length, a history kept for several calls (cached places), replaced,
    and empty."""
    rng = np.random.default_rng(2)
    shared = ngram_tree.TrieCorpus()
    history_lists, history = [], np.zeros(0, dtype=np.int64)
    for call in range(500):
        if call % 7 == 0:  # a request finished (a new array object), or the history was flushed
            history_lists = [] if call % 35 == 0 else history_lists + [rng.integers(0, 6, 20).tolist()]
            history = corpus_of(history_lists, [])
        seq = rng.integers(0, 6, int(rng.integers(1, 60))).tolist()
        shape = TrieTreeShape(num_nodes=12, max_breadth=4, min_breadth=1, max_trie_depth=6, match_type="BFS")
        corpus, first = shared.corpus(history, np.asarray(seq, dtype=np.int64))
        before = np.concatenate([history, [SEPARATOR], seq]) if len(history) else np.asarray(seq)  # the old copy
        assert np.array_equal(corpus, before)
        assert np.array_equal(first, np.flatnonzero(corpus[:-1] == seq[-1]) + 1)
        got = trie_tree(corpus, np.asarray(seq, dtype=np.int64), shape, first)
        assert got == reference_tree(history_lists, seq, shape), (call, history_lists, seq)


def test_a_repeated_phrase_is_drafted_whole_and_a_branch_point_branches():
    seq = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 9, 1, 2]  # "1 2" was followed by "3 4 5" and then by "3 7 8"
    shape = TrieTreeShape(num_nodes=8, max_breadth=4, min_breadth=1, max_trie_depth=6, match_type="BFS")
    tokens, parents = trie_tree(np.asarray(seq), np.asarray(seq), shape)
    paths = {tuple(_path(tokens, parents, i)) for i in range(len(tokens))}
    assert (2, 3, 7, 8) in paths and (2, 3, 4, 5) in paths  # the latest continuation and the older one
    assert len(tokens) <= 8 and all(p < i for i, p in enumerate(parents) if i)


def _path(tokens, parents, i):
    out = []
    while i >= 0:
        out.append(tokens[i])
        i = parents[i]
    return out[::-1]


# ---- in the engine ------------------------------------------------------------------------------------------------

from hyperdraft import SamplingParams  # noqa: E402
from hyperdraft.config import EngineArgs  # noqa: E402
from hyperdraft.speculative.adaptive.tier import Tier  # noqa: E402
from hyperdraft.speculative.config import NgramTrie, resolve_spec_config  # noqa: E402

from helpers.spec_fixtures import (_single_torch_thread, gen, greedy, llm_factory, mixed_prompts,  # noqa: F401,E402
                                   spec_models)

TRIES = {
    "bfs-default": dict(speculative_ngram_match_type="BFS"),
    "prob": dict(speculative_ngram_match_type="PROB", speculative_ngram_max_bfs_breadth=4),
    "bfs-narrow-deep": dict(speculative_ngram_min_bfs_breadth=2, speculative_ngram_max_bfs_breadth=3,
                            speculative_ngram_max_trie_depth=6, speculative_num_draft_tokens=9),
    "breadth-1-chain": dict(speculative_ngram_max_bfs_breadth=1, speculative_num_draft_tokens=6),
}


@pytest.mark.parametrize("trie", TRIES, ids=list(TRIES))
def test_greedy_output_equals_plain_decoding(spec_models, llm_factory, trie):
    """Repeating and random prompts batched together (unsharpened tiny target: near-tied logits), then the same
    prompts again, drafted from the first answers too."""
    prompts = mixed_prompts(6, seed=3, max_len=60)
    want = [o.token_ids for o in gen(llm_factory(spec_models["target"]), prompts, greedy(48))]
    llm = llm_factory(spec_models["target"], speculative_algorithm="NGRAM", **TRIES[trie])
    for _ in range(2):
        outs = gen(llm, prompts, greedy(48))
        assert [o.token_ids for o in outs] == want
    assert sum(o.meta_info["spec_accepted_tokens"] for o in outs) > 0  # the trees were verified, and matched


@pytest.mark.parametrize("sampling", ["coupled", "rejection"])
def test_seeded_sampling_under_coupled_verification_is_plain_decoding(spec_models, llm_factory, sampling):
    """Coupled: a draft is accepted iff it is the target's own keyed sample, so seeded output equals plain decoding's.
    Rejection: the same rounds through the residual-resampling walk (no equality to plain decoding is promised)."""
    prompts = mixed_prompts(4, seed=8, max_len=40)
    params = [SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=40, ignore_eos=True, seed=100 + i)
              for i in range(len(prompts))]
    plain = [o.token_ids for o in gen(llm_factory(spec_models["target"]), prompts, params)]
    llm = llm_factory(spec_models["target"], speculative_algorithm="NGRAM", speculative_sampling=sampling,
                      **TRIES["bfs-default"])
    first = [o.token_ids for o in gen(llm, prompts, params)]
    alone = [gen(llm, [p], [sp])[0].token_ids for p, sp in zip(prompts, params)]
    assert all(len(t) == 40 for t in first + alone)
    if sampling == "coupled":
        assert first == plain and alone == plain


def test_trie_flags_resolve_as_sglang():
    spec = resolve_spec_config(EngineArgs(speculative_algorithm="NGRAM", speculative_ngram_match_type="PROB"))
    assert spec.tier == Tier(11, 10, 12) and spec.ngram_trie == NgramTrie(1, 18, "PROB")
    spec = resolve_spec_config(EngineArgs(speculative_algorithm="NGRAM", speculative_ngram_max_bfs_breadth=4,
                                          speculative_num_draft_tokens=8, speculative_eagle_topk=2))
    assert spec.tier == Tier(7, 4, 8)  # topk := max breadth, as SGLang
    chain = resolve_spec_config(EngineArgs(speculative_algorithm="NGRAM", speculative_num_steps=4))
    assert chain.ngram_trie is None and chain.tier == Tier(4)  # no trie flag: the prompt-lookup chain


@pytest.mark.parametrize("args, message", [
    (dict(speculative_ngram_min_bfs_breadth=5, speculative_ngram_max_bfs_breadth=3),
     r"speculative_ngram_min_bfs_breadth must be an integer in \[1, speculative_ngram_max_bfs_breadth=3\], got 5"),
    (dict(speculative_ngram_max_bfs_breadth=0), r"speculative_ngram_max_bfs_breadth must be an integer >= 1, got 0"),
    (dict(speculative_ngram_max_trie_depth=1), r"speculative_ngram_max_trie_depth must be an integer >= 2"),
    (dict(speculative_ngram_match_type="DFS"), r"speculative_ngram_match_type must be one of BFS, PROB, got 'DFS'"),
    (dict(speculative_ngram_match_type="BFS", speculative_num_draft_tokens=1),
     r"speculative_num_draft_tokens must be >= 2"),
])
def test_bad_trie_flags_are_named(args, message):
    with pytest.raises(ValueError, match=message):
        resolve_spec_config(EngineArgs(speculative_algorithm="NGRAM", **args))


def test_trie_flags_are_ignored_outside_ngram(caplog):
    """As SGLang, where they are defaults only its NGRAM worker reads: one launch template serves every algorithm."""
    eagle = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path="/x")
    with caplog.at_level(logging.WARNING, logger="hyperdraft"):
        spec = resolve_spec_config(EngineArgs(**eagle, speculative_ngram_max_trie_depth=4,
                                              speculative_ngram_max_bfs_breadth=10))
    assert spec.ngram_trie is None and spec.tier == resolve_spec_config(EngineArgs(**eagle)).tier
    assert "speculative_ngram_max_bfs_breadth, speculative_ngram_max_trie_depth ignored" in caplog.text


def test_chain_windows_beside_a_trie_flag_are_said_to_be_unused(caplog):
    with caplog.at_level(logging.WARNING, logger="hyperdraft"):
        spec = resolve_spec_config(EngineArgs(speculative_algorithm="NGRAM", speculative_ngram_match_type="BFS"))
    assert spec.ngram_trie is not None and "match_window_size" not in caplog.text
    with caplog.at_level(logging.WARNING, logger="hyperdraft"):
        resolve_spec_config(EngineArgs(speculative_algorithm="NGRAM", speculative_ngram_match_type="BFS",
                                       speculative_ngram_max_match_window_size=3))
    assert "speculative_ngram_min/max_match_window_size (the prompt-lookup chain's) are unused" in caplog.text


def test_the_tree_reserves_only_its_verify_width():
    """No draft K/V: a round needs the 12 verified nodes' room, not a beam's 1 + 10 * 10 fed nodes."""
    spec = resolve_spec_config(EngineArgs(speculative_algorithm="NGRAM", speculative_ngram_match_type="BFS"))
    assert spec.tier.reserve_tokens == 101 and spec.max_verify_tokens == 12


def test_an_anchor_keeps_its_latest_occurrences(monkeypatch):
    """MAX_ROWS: "7" was followed by 1, 2, then 3; kept to its two latest occurrences, the tree drafts 3 and 2."""
    seq = np.asarray([7, 1, 7, 2, 7, 3, 7])
    shape = TrieTreeShape(num_nodes=8, max_breadth=10, min_breadth=1, max_trie_depth=18, match_type="BFS")

    def root_children():
        tokens, parents = trie_tree(seq, seq, shape)
        return {t for t, p in zip(tokens, parents) if p == 0}

    assert root_children() == {1, 2, 3}
    monkeypatch.setattr(ngram_tree, "MAX_ROWS", 2)
    assert root_children() == {2, 3}


def test_adaptive_falls_back_to_the_static_tree_with_a_warning(caplog):
    """As SGLang: adaptive speculation covers EAGLE chains there, and NGRAM gets its static parameters."""
    spec = resolve_spec_config(EngineArgs(speculative_algorithm="NGRAM", speculative_ngram_match_type="BFS",
                                          speculative_adaptive=True))
    assert spec.adaptive is None and spec.tier == Tier(11, 10, 12)
    assert "speculative_adaptive disabled: the NGRAM trie tree has one shape" in caplog.text


@pytest.mark.parametrize("match_type", ["BFS", "PROB"])
def test_a_looping_answer_equals_a_literal_trie(match_type):
    """Every suffix of a repeated phrase occurs where the phrase does: anchors of many lengths share one set of rows
    (ngram_tree._Rows groups their nodes once). A phrase of 7 with one variant, repeated, then cut mid-phrase."""
    phrase = [4, 9, 2, 7, 7, 1, 3]
    seq = (phrase * 6 + [4, 9, 5] + phrase * 3)[:-2]
    for depth in (4, 9, 18):
        for num_nodes in (6, 12, 20):
            shape = TrieTreeShape(num_nodes, 4, 1, depth, match_type)
            assert trie_tree(np.asarray(seq), np.asarray(seq), shape) == reference_tree([], seq, shape), (depth,
                                                                                                           num_nodes)
