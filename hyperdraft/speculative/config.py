"""SpecConfig: the resolved speculative settings, with SGLang's defaults and checks.

EngineArgs keeps what the user typed; resolve_spec_config derives the values the engine runs with (auto-defaults,
forced draft-token counts, the adaptive ladders) into a new frozen object, so nothing is ever mutated after start-up.
A tier's bounds and its K/V reservation are Tier's (adaptive/tier.py); what each algorithm can draft is
hyperdraft.config.SPECULATIVE_ALGORITHMS.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from hyperdraft.config import (NGRAM_MATCH_WINDOWS, SPECULATIVE_ALGORITHMS, SPECULATIVE_ALIASES, SPECULATIVE_NOT_YET,
                               EngineArgs)
from hyperdraft.options import RuntimeOptions
from hyperdraft.speculative.adaptive.config import AdaptiveConfig, load_adaptive_config, resolve_initial_steps
from hyperdraft.speculative.adaptive.tier import Tier, max_tree_tokens

logger = logging.getLogger("hyperdraft")

NGRAM_DEFAULT_DRAFT_TOKENS = 8
NGRAM_TRIE_FLAGS = ("speculative_ngram_min_bfs_breadth", "speculative_ngram_max_bfs_breadth",
                    "speculative_ngram_match_type", "speculative_ngram_max_trie_depth")
NGRAM_TRIE_MATCH_TYPES = ("BFS", "PROB")


@dataclass(frozen=True)
class NgramTrie:
    """SGLang 0.5.23's NGRAM tree (proposers/ngram_tree.py); its breadth cap is the tier's topk, its size the tier's
    num_draft_tokens."""

    min_breadth: int = 1
    max_trie_depth: int = 18
    match_type: str = "BFS"


@dataclass(frozen=True)
class SpecConfig:
    algorithm: str  # a key of SPECULATIVE_ALGORITHMS
    tier: Tier  # the tier a step starts with (the only one without adaptive speculation)
    draft_model_path: str | None
    use_rejection_sampling: bool | None  # drafts drawn from q (True), one-hot q (False), or per step (None: auto)
    sampling: str  # "coupled" or "rejection": how sampled requests are verified (verify/coupled.py, rejection.py)
    ngram_min_window: int
    ngram_max_window: int
    adaptive: AdaptiveConfig | None = None  # set when speculative_adaptive: the tier ladder per batch-size slot
    simulate_accept_rate: float | None = None  # benchmark-only LOSSY accept decision (verify/simulated.py)
    simulate_sibling_rate: float | None = None  # with it, trees: a lower-ranked child's chance (verify/simulated.py)
    token_map: str | None = None  # hot token ids for a full-vocabulary head's draft lm_head (models/hot_vocab.py)
    ngram_trie: NgramTrie | None = None  # NGRAM drafts SGLang 0.5.23's trie tree instead of the prompt-lookup chain

    @property
    def num_steps(self) -> int:
        return self.tier.steps

    @property
    def topk(self) -> int:
        return self.tier.topk

    @property
    def num_draft_tokens(self) -> int:
        return self.tier.num_draft_tokens

    @property
    def is_tree(self) -> bool:
        return self.tier.is_tree

    def tiers(self) -> list[Tier]:
        """Every tier a step can run: the adaptive ladders' union, or the one tier."""
        return self.adaptive.candidate_union() if self.adaptive is not None else [self.tier]

    @property
    def max_verify_tokens(self) -> int:
        """K/V room a round can need past the committed tokens (Tier.reserve_tokens), over every tier that can run,
        never the initial one alone: pools and buffers are never resized mid-run. A drafter without a model writes
        no draft K/V, so its rounds need only the verify's width (NGRAM's 12-node trie tree at topk 10: 12, where
        a beam of that shape would feed 101)."""
        tiers = self.tiers() + [self.tier]
        if not SPECULATIVE_ALGORITHMS[self.algorithm].draft_model:
            return max(t.num_draft_tokens for t in tiers)
        return max(t.reserve_tokens for t in tiers)

    @property
    def max_steps(self) -> int:
        """The deepest draft any tier can run: sizes the per-position acceptance counters."""
        return max(t.steps for t in self.tiers() + [self.tier])


def resolve_spec_config(args: EngineArgs, target_architecture: str | None = None,
                        options: RuntimeOptions | None = None) -> SpecConfig | None:
    """The simulated accept rate is args.speculative_simulate_accept_rate, else options' (the environment's)."""
    if args.speculative_algorithm is None:
        return None
    algo = _algorithm(args.speculative_algorithm)
    steps, topk, draft_tokens = args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens
    adaptive = None
    if args.speculative_adaptive:
        adaptive = load_adaptive_config(args.speculative_adaptive_config, topk or 1, draft_tokens)
        steps = resolve_initial_steps(adaptive, steps)  # SGLang: the middle of the candidate union when unset
        initial = next(t for t in adaptive.candidate_union() if t.steps == steps)
        topk, draft_tokens = initial.topk, initial.num_draft_tokens
        if not SPECULATIVE_ALGORITHMS[algo].trees and any(t.is_tree for t in adaptive.candidate_union()):
            raise ValueError(f"speculative_adaptive_config: tree tiers (topk > 1) are not supported for {algo}")
    elif args.speculative_adaptive_config:  # SGLang reads the config only under the flag
        logger.warning("speculative_adaptive_config is ignored: speculative_adaptive is off")
    if SPECULATIVE_ALGORITHMS[algo].draft_model:
        if not args.speculative_draft_model_path and not SPECULATIVE_ALGORITHMS[algo].own_mtp:
            raise ValueError(f"speculative_draft_model_path is required for speculative_algorithm {algo}")
        if steps is None and topk is None and draft_tokens is None:
            # SGLang's auto-choice: Llama targets get a tree for EAGLE; everything else a 3-step chain.
            llama_eagle = algo != "STANDALONE" and target_architecture == "LlamaForCausalLM"
            steps, topk, draft_tokens = (5, 4, 8) if llama_eagle else (3, 1, 4)
    else:  # a deterministic chain of up to num_draft_tokens - 1 tokens
        given = args.speculative_num_draft_tokens  # an adaptive step-0 tier's own count is 1
        if given is not None and given < 2:
            raise ValueError(f"speculative_num_draft_tokens must be >= 2 for {algo} (the last token and at least one "
                             f"draft), got {given}")
        if steps is None:
            draft_tokens = draft_tokens or NGRAM_DEFAULT_DRAFT_TOKENS
            steps = draft_tokens - 1
        if args.speculative_use_rejection_sampling:
            raise ValueError(f"speculative_use_rejection_sampling needs a draft model; {algo} drafts are deterministic")
    trie = _ngram_trie(args, algo)
    if trie is not None and adaptive is not None:  # as SGLang's NGRAM: a warning, then the static shape
        logger.warning("speculative_adaptive disabled: the NGRAM trie tree has one shape. Falling back to static "
                       "speculative params.")
        adaptive = None
    tier = _ngram_trie_tier(args) if trie is not None else _initial_tier(algo, steps, topk, draft_tokens,
                                                                            adaptive is not None)
    if not 1 <= args.speculative_ngram_min_match_window_size <= args.speculative_ngram_max_match_window_size:
        raise ValueError("speculative_ngram_min_match_window_size must be >= 1 and <= speculative_ngram_max_match_window_size")
    token_map = _token_map(args, algo)
    alpha = args.speculative_simulate_accept_rate
    if alpha is None:
        alpha = (options or RuntimeOptions.from_env()).simulate_accept_rate
    if alpha is not None:
        logger.warning("speculative_simulate_accept_rate=%s: verification is SIMULATED; outputs are not the target "
                       "model's (benchmark mode)", alpha)
    return SpecConfig(algo, tier, args.speculative_draft_model_path,
                      args.speculative_use_rejection_sampling if SPECULATIVE_ALGORITHMS[algo].draft_model else False,
                      _sampling_mode(args),
                      args.speculative_ngram_min_match_window_size, args.speculative_ngram_max_match_window_size,
                      adaptive, simulate_accept_rate=alpha,
                      simulate_sibling_rate=args.speculative_simulate_sibling_rate if alpha is not None else None,
                      token_map=token_map, ngram_trie=trie)


def check_topk_fits(spec: SpecConfig, vocab: int, source: str, flag_topk: int | None) -> None:
    """A beam takes each node's topk most likely children from the drafter's vocabulary (source: its name, vocab: its
    size), so no tier may ask for more. Checked once the drafter is loaded: past it torch.topk failed mid-run on CPU
    ("selected index k out of range"), and CUDA's top-k kernel asserted k <= its width (an EAGLE-3 head's
    draft_vocab_size) at the first round. The message names what set the topk: the flag (flag_topk, the
    speculative_eagle_topk given), else the adaptive ladder's tier, else the automatic choice."""
    widest = max(spec.tiers() + [spec.tier], key=lambda t: t.topk)
    if widest.topk <= vocab:
        return
    if flag_topk is not None and flag_topk > vocab:
        field = "speculative_eagle_topk"
    elif spec.adaptive is not None:
        field = f"speculative_adaptive_config tier {widest.describe()}: topk"
    else:
        field = "speculative_eagle_topk (unset, chosen automatically)"
    raise ValueError(f"{field} must be in [1, {vocab}]: {source} has {vocab} tokens to draft a node's children from, "
                     f"got {widest.topk}")


def _token_map(args: EngineArgs, algo: str) -> str | None:
    token_map = args.speculative_token_map
    if token_map is not None and algo == "EAGLE3":  # as SGLang: a warning, and the head's own vocabulary
        logger.warning("speculative_token_map=%s is ignored: an EAGLE3 head carries its own draft vocabulary "
                       "(draft_vocab_size, d2t)", token_map)
        return None
    if token_map is not None and algo == "NGRAM":  # SGLang's NGRAM worker never reads it either
        logger.warning("speculative_token_map=%s is ignored: NGRAM drafts by lookup, with no vocabulary to cut",
                       token_map)
        return None
    if token_map is not None and algo != "EAGLE":
        raise ValueError(f"speculative_token_map is for EAGLE, NEXTN and MTP heads (they score the whole vocabulary), "
                         f"not speculative_algorithm {algo}")
    return token_map


def _sampling_mode(args: EngineArgs) -> str:
    """Coupled unless rejection sampling is asked for, by name or by speculative_use_rejection_sampling=True."""
    if args.speculative_use_rejection_sampling:
        if args.speculative_sampling == "coupled":
            raise ValueError("speculative_use_rejection_sampling=True verifies drafts drawn from q by rejection "
                             "sampling; it cannot be combined with speculative_sampling=coupled")
        return "rejection"
    return args.speculative_sampling or "coupled"


def _algorithm(name: str) -> str:
    algo = str(name).upper()
    algo = SPECULATIVE_ALIASES.get(algo, algo)
    supported = ", ".join(SPECULATIVE_ALGORITHMS)
    if algo in SPECULATIVE_NOT_YET:
        raise ValueError(f"speculative_algorithm {algo} is not yet supported; supported now: {supported}")
    if algo not in SPECULATIVE_ALGORITHMS:
        raise ValueError(f"speculative_algorithm must be one of {supported}, got {name!r}")
    return algo


def _initial_tier(algo: str, steps: int | None, topk: int | None, draft_tokens: int | None, adaptive: bool) -> Tier:
    """The flags' tier, checked with the flags' names (Tier's own bounds, said in the user's terms)."""
    if steps is None:
        raise ValueError("speculative_num_steps must be set when speculative_eagle_topk or speculative_num_draft_tokens is")
    if steps < 1 and not (adaptive and steps == 0):  # adaptive may start at step 0 (no speculation)
        raise ValueError(f"speculative_num_steps must be >= 1, got {steps}")
    topk = 1 if topk is None else topk
    if topk < 1:
        raise ValueError(f"speculative_eagle_topk must be >= 1, got {topk}")
    if topk > 1 and not SPECULATIVE_ALGORITHMS[algo].trees:
        trie = " (for SGLang 0.5.23's trie tree, set speculative_ngram_max_bfs_breadth)" if algo == "NGRAM" else ""
        raise ValueError(f"speculative_eagle_topk > 1 is not supported for {algo}; {algo} drafts a chain{trie}")
    if topk == 1 and draft_tokens != steps + 1:
        if draft_tokens is not None:
            logger.warning("speculative_num_draft_tokens is adjusted to speculative_num_steps + 1 when speculative_eagle_topk == 1")
        draft_tokens = steps + 1
    if topk > 1:
        most = max_tree_tokens(steps, topk)
        if draft_tokens is None or not 2 <= draft_tokens <= most:
            raise ValueError(f"speculative_num_draft_tokens must be in [2, {most}] for speculative_num_steps={steps} "
                             f"and speculative_eagle_topk={topk} (the root plus at most {most - 1} candidate nodes), "
                             f"got {draft_tokens}")
    return Tier(steps, topk, draft_tokens)


def _ngram_trie(args: EngineArgs, algo: str) -> NgramTrie | None:
    """The trie tree's settings when any of its flags is given (SGLang 0.5.23's NGRAM), checked by name."""
    given = [name for name in NGRAM_TRIE_FLAGS if getattr(args, name) is not None]
    if not given:
        return None
    if algo != "NGRAM":  # as SGLang, where they are plain defaults that only its NGRAM worker reads
        logger.warning("%s ignored: the NGRAM trie tree's flags do nothing for speculative_algorithm %s",
                       ", ".join(given), algo)
        return None
    windows = (args.speculative_ngram_min_match_window_size, args.speculative_ngram_max_match_window_size)
    if windows != NGRAM_MATCH_WINDOWS:
        logger.warning("speculative_ngram_min/max_match_window_size (the prompt-lookup chain's) are unused: %s "
                       "selects the trie tree, whose anchors are bounded by speculative_ngram_max_trie_depth", given[0])
    min_breadth = 1 if args.speculative_ngram_min_bfs_breadth is None else args.speculative_ngram_min_bfs_breadth
    max_breadth = _trie_max_breadth(args)
    if not isinstance(min_breadth, int) or not 1 <= min_breadth <= max_breadth:
        raise ValueError(f"speculative_ngram_min_bfs_breadth must be an integer in [1, speculative_ngram_max_bfs_breadth="
                         f"{max_breadth}], got {min_breadth!r}")
    depth = 18 if args.speculative_ngram_max_trie_depth is None else args.speculative_ngram_max_trie_depth
    if not isinstance(depth, int) or isinstance(depth, bool) or depth < 2:
        raise ValueError(f"speculative_ngram_max_trie_depth must be an integer >= 2 (a matched token and one to draft), "
                         f"got {depth!r}")
    match_type = "BFS" if args.speculative_ngram_match_type is None else args.speculative_ngram_match_type
    if match_type not in NGRAM_TRIE_MATCH_TYPES:
        raise ValueError(f"speculative_ngram_match_type must be one of {', '.join(NGRAM_TRIE_MATCH_TYPES)}, "
                         f"got {match_type!r}")
    return NgramTrie(min_breadth, depth, match_type)


def _trie_max_breadth(args: EngineArgs) -> int:
    breadth = 10 if args.speculative_ngram_max_bfs_breadth is None else args.speculative_ngram_max_bfs_breadth
    if not isinstance(breadth, int) or isinstance(breadth, bool) or breadth < 1:
        raise ValueError(f"speculative_ngram_max_bfs_breadth must be an integer >= 1, got {breadth!r}")
    return breadth


def _ngram_trie_tier(args: EngineArgs) -> Tier:
    """SGLang 0.5.23: topk := speculative_ngram_max_bfs_breadth, 12 draft tokens unless given; the tree may be as
    deep as its nodes reach, so the tier's depth is num_draft_tokens - 1 (speculative_num_steps is not used)."""
    topk, draft_tokens = _trie_max_breadth(args), args.speculative_num_draft_tokens
    if args.speculative_eagle_topk is not None and args.speculative_eagle_topk != topk:
        logger.warning("speculative_eagle_topk=%s is replaced by speculative_ngram_max_bfs_breadth=%s for the NGRAM "
                       "trie tree (as SGLang)", args.speculative_eagle_topk, topk)
    if draft_tokens is None:
        draft_tokens = 12
    if not isinstance(draft_tokens, int) or draft_tokens < 2:
        raise ValueError(f"speculative_num_draft_tokens must be >= 2 for the NGRAM trie tree (the last token and at "
                         f"least one draft), got {draft_tokens!r}")
    return Tier(draft_tokens - 1, topk, draft_tokens)
