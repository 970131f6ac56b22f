"""SpecConfig: the resolved speculative settings, with SGLang's defaults and checks.

EngineArgs keeps what the user typed; resolve_spec_config derives the values
the engine runs with (auto-defaults, forced draft-token counts) into a new
frozen object, so nothing is ever mutated after start-up.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from hyperdraft.config import EngineArgs

logger = logging.getLogger("hyperdraft")

SUPPORTED = ("NGRAM", "STANDALONE", "EAGLE", "EAGLE3")
ALIASES = {"NEXTN": "EAGLE"}
NOT_YET = ("MTP",)
NGRAM_DEFAULT_DRAFT_TOKENS = 8
SIMULATE_ENV = "HYPERDRAFT_SIMULATE_ACCEPT_RATE"


@dataclass(frozen=True)
class SpecConfig:
    algorithm: str  # NGRAM | STANDALONE
    num_steps: int  # draft tokens per round
    topk: int
    num_draft_tokens: int  # verified tokens per request per round, the root (last committed token) included
    draft_model_path: str | None
    use_rejection_sampling: bool | None  # drafts drawn from q (True), one-hot q (False), or per step (None: auto)
    ngram_min_window: int
    ngram_max_window: int
    adaptive: "AdaptiveConfig | None" = None  # set when speculative_adaptive: the tier ladder per batch-size slot
    simulate_accept_rate: float | None = None  # benchmark-only LOSSY accept decision (speculative/verify/simulated.py)

    @property
    def is_tree(self) -> bool:
        return self.topk > 1

    @property
    def max_verify_tokens(self) -> int:
        """K/V room a round can need past the committed tokens: the verify tree (root included), or the draft's
        own tree nodes (root + (steps-1)*topk fed nodes), whichever is larger. Under adaptive speculation it is
        the maximum over every tier that can run, never the initial one: pools are never resized mid-run."""
        static = max(self.num_draft_tokens, 1 + (self.num_steps - 1) * self.topk)
        return max(static, self.adaptive.max_reserve_tokens()) if self.adaptive is not None else static

    @property
    def max_steps(self) -> int:
        """The deepest draft any tier can run: sizes the per-position acceptance counters."""
        if self.adaptive is None:
            return self.num_steps
        return max([self.num_steps] + [t.steps for t in self.adaptive.candidate_union()])


def resolve_spec_config(args: EngineArgs, target_architecture: str | None = None) -> SpecConfig | None:
    if args.speculative_algorithm is None:
        return None
    algo = str(args.speculative_algorithm).upper()
    algo = ALIASES.get(algo, algo)
    if algo in NOT_YET:
        raise ValueError(f"speculative_algorithm {algo} is not yet supported; supported now: {', '.join(SUPPORTED)}")
    if algo not in SUPPORTED:
        raise ValueError(f"speculative_algorithm must be one of {', '.join(SUPPORTED)}, got {args.speculative_algorithm!r}")
    steps, topk, draft_tokens = args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens
    adaptive = None
    if args.speculative_adaptive:
        from hyperdraft.speculative.adaptive.ema import load_adaptive_config, resolve_initial_steps

        adaptive = load_adaptive_config(args.speculative_adaptive_config, topk or 1, draft_tokens)
        steps = resolve_initial_steps(adaptive, steps)  # SGLang: the middle of the candidate union when unset
        initial = next(t for t in adaptive.candidate_union() if t.steps == steps)
        topk, draft_tokens = initial.topk, initial.num_draft_tokens
        if algo == "NGRAM" and any(t.is_tree for t in adaptive.candidate_union()):
            raise ValueError("speculative_adaptive_config: tree tiers (topk > 1) are not supported for NGRAM")
    elif args.speculative_adaptive_config:
        raise ValueError("speculative_adaptive_config is given but speculative_adaptive is off")
    if algo in ("STANDALONE", "EAGLE", "EAGLE3"):
        if not args.speculative_draft_model_path:
            raise ValueError(f"speculative_draft_model_path is required for speculative_algorithm {algo}")
        if steps is None and topk is None and draft_tokens is None:
            # SGLang's auto-choice: Llama targets get a tree for EAGLE; everything else a 3-step chain.
            llama_eagle = algo != "STANDALONE" and target_architecture == "LlamaForCausalLM"
            steps, topk, draft_tokens = (5, 4, 8) if llama_eagle else (3, 1, 4)
    else:  # NGRAM proposes a chain of up to num_draft_tokens - 1 tokens
        if steps is None:
            draft_tokens = draft_tokens or NGRAM_DEFAULT_DRAFT_TOKENS
            steps = draft_tokens - 1
        if args.speculative_use_rejection_sampling:
            raise ValueError("speculative_use_rejection_sampling needs a draft model; NGRAM drafts are deterministic")
    if steps is None:
        raise ValueError("speculative_num_steps must be set when speculative_eagle_topk or speculative_num_draft_tokens is")
    if steps < 1 and not (adaptive is not None and steps == 0):  # adaptive may start at step 0 (no speculation)
        raise ValueError(f"speculative_num_steps must be >= 1, got {steps}")
    topk = 1 if topk is None else topk
    if topk < 1:
        raise ValueError(f"speculative_eagle_topk must be >= 1, got {topk}")
    if topk > 1 and algo == "NGRAM":
        raise ValueError("speculative_eagle_topk > 1 is not supported for NGRAM; NGRAM drafts a chain")
    if topk == 1 and draft_tokens != steps + 1:
        if draft_tokens is not None:
            logger.warning("speculative_num_draft_tokens is adjusted to speculative_num_steps + 1 when speculative_eagle_topk == 1")
        draft_tokens = steps + 1
    if topk > 1:
        candidates = topk + (steps - 1) * topk * topk
        if draft_tokens is None or not 2 <= draft_tokens <= candidates + 1:
            raise ValueError(f"speculative_num_draft_tokens must be in [2, {candidates + 1}] for speculative_num_steps={steps} "
                             f"and speculative_eagle_topk={topk} (the root plus at most {candidates} candidate nodes), "
                             f"got {draft_tokens}")
    if not 1 <= args.speculative_ngram_min_match_window_size <= args.speculative_ngram_max_match_window_size:
        raise ValueError("speculative_ngram_min_match_window_size must be >= 1 and <= speculative_ngram_max_match_window_size")
    return _finish(algo, args, steps, topk, draft_tokens, adaptive)


def simulated_accept_rate(args: EngineArgs) -> float | None:
    """speculative_simulate_accept_rate, or the HYPERDRAFT_SIMULATE_ACCEPT_RATE environment variable."""
    value = args.speculative_simulate_accept_rate
    env = os.environ.get(SIMULATE_ENV)
    if value is None and env:
        try:
            value = float(env)
        except ValueError:
            raise ValueError(f"{SIMULATE_ENV} must be a number in [0, 1], got {env!r}") from None
        if not 0 <= value <= 1:
            raise ValueError(f"{SIMULATE_ENV} must be in [0, 1], got {value}")
    return value


def _finish(algo, args, steps, topk, draft_tokens, adaptive) -> SpecConfig:
    alpha = simulated_accept_rate(args)
    if alpha is not None:
        logger.warning("speculative_simulate_accept_rate=%s: verification is SIMULATED; outputs are not the target "
                       "model's (benchmark mode)", alpha)
    return SpecConfig(
        simulate_accept_rate=alpha,
        algorithm=algo,
        num_steps=steps,
        topk=topk,
        num_draft_tokens=draft_tokens,
        adaptive=adaptive,
        draft_model_path=args.speculative_draft_model_path,
        use_rejection_sampling=False if algo == "NGRAM" else args.speculative_use_rejection_sampling,
        ngram_min_window=args.speculative_ngram_min_match_window_size,
        ngram_max_window=args.speculative_ngram_max_match_window_size,
    )
