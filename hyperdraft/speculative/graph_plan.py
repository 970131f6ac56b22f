"""What a speculative engine captures in CUDA graphs: the target's verify shapes and the drafter's step, catch-up and
whole-round shapes, for every tier that can run and only at the batch sizes routed to it.

CapturePlan comes from the tier source (a static tier runs at every captured size; adaptive slots route sizes to
their ladders). The target's shapes follow from the tiers alone (verify_shapes); a drafter adds its own from its
catch-up widths (draft_step_shapes, draft_loop_plan). Anything a plan leaves out runs eagerly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hyperdraft.core.forward_batch import ForwardMode
from hyperdraft.runner.graph_runner import GraphRunner, GraphShape
from hyperdraft.speculative.adaptive.tier import Tier
from hyperdraft.speculative.drafting.sampled_tree import level_budgets

Shapes = dict[GraphShape, list[int]]  # shape -> the batch sizes to capture it at


@dataclass(frozen=True)
class CapturePlan:
    sizes: tuple[int, ...]  # every captured batch size
    tier_sizes: dict[Tier, list[int]]  # tier -> the captured sizes that can run it
    may_sample: bool  # drafts may be drawn from q (sampled trees need their own step shapes)

    def drafting(self) -> dict[Tier, list[int]]:
        return {tier: sizes for tier, sizes in self.tier_sizes.items() if tier.steps > 0 and sizes}


def verify_shapes(plan: CapturePlan, decodes_everywhere: bool = False) -> dict[ForwardMode, Shapes]:
    """The target's shapes: each drafting tier's verify width (with the tree mask for trees), and one-token decodes
    for a steps-0 tier, or at every size with decodes_everywhere (a drafter whose rounds may draft nothing, run as
    plain decodes: speculative/worker.py)."""
    verify: Shapes = {}
    decode: Shapes = {GraphShape(1, 0): list(plan.sizes)} if decodes_everywhere else {}
    for tier, sizes in plan.tier_sizes.items():
        if tier.steps == 0:
            _add(decode, GraphShape(1, 0), sizes)
        else:
            _add(verify, verify_shape(tier), sizes)
    return {ForwardMode.DECODE: decode, ForwardMode.TARGET_VERIFY: verify}


def verify_shape(tier: Tier) -> GraphShape:
    """The shape a drafting tier's verify is captured at: its width per request, with the tree mask's for trees."""
    q = tier.num_draft_tokens
    return GraphShape(q, q if tier.is_tree else 0)


def verify_graph_runs(graphs: GraphRunner | None, tier: Tier, batch_size: int) -> bool:
    """Whether a captured graph runs this many requests' verify at the tier's width (after padding)."""
    return graphs is not None and graphs.fits(verify_shape(tier), batch_size)


def draft_step_shapes(plan: CapturePlan, catch_up_width: Callable[[Tier], int]) -> dict[ForwardMode, Shapes]:
    """The drafter's per-forward shapes: its one-token (chain) draft step; each tree tier's draft steps, one shape per
    depth (frontier size, tail-mask width), for a beam and, when drafts may be drawn from q, for a sampled tree's
    level budgets; and the catch-up extend, padded per batch size to the widest catch-up a tier routed there can
    leave for the next round. Greedy rounds run as one graph each (draft_loop_plan); these serve the rest."""
    steps: Shapes = {GraphShape(1, 0): list(plan.sizes)}
    for tier, sizes in plan.drafting().items():
        if tier.is_tree:
            for k, w in tree_step_shapes(tier.steps, tier.topk, tier.num_draft_tokens, plan.may_sample):
                _add(steps, GraphShape(k, w), sizes)
    extend: Shapes = {}
    for size, width in catch_up_widths(plan, catch_up_width).items():
        if width > 1:  # width 1 is the one-token decode graph
            _add(extend, GraphShape(width, 0, one_logit=True), [size])
    return {ForwardMode.DECODE: steps, ForwardMode.DRAFT_EXTEND: extend}


def catch_up_widths(plan: CapturePlan, catch_up_width: Callable[[Tier], int]) -> dict[int, int]:
    """Batch size -> the widest catch-up a drafting tier routed to it can leave."""
    width_of: dict[int, int] = {}
    for tier, sizes in plan.drafting().items():
        for size in sizes:
            width_of[size] = max(width_of.get(size, 1), catch_up_width(tier))
    return width_of


def draft_loop_plan(plan: CapturePlan, catch_up_width: Callable[[Tier], int],
                    step_zero: bool = False) -> dict[Tier, dict[int, int]]:
    """Tier -> {batch size: widest catch-up}: the whole-round draft graphs of every drafting tier, chain or tree, at
    the batch sizes routed to it (drafting/graphs.py). step_zero: the drafter catches up at step 0 too (an EAGLE head
    feeds on every token), so step-0 tiers get a round graph of the catch-up alone, which it can queue ahead."""
    width_of = catch_up_widths(plan, catch_up_width)
    tiers = {t: sizes for t, sizes in plan.tier_sizes.items() if sizes and (t.steps > 0 or step_zero)}
    return {tier: {size: width_of.get(size, 1) for size in sizes} for tier, sizes in tiers.items()}


def tree_step_shapes(steps: int, topk: int, num_nodes: int, sampled: bool) -> set[tuple[int, int]]:
    """(tokens per request, tail-mask width) of every tree draft forward after the root's, as the beam's step_mask
    builds them: a beam feeds topk nodes at each depth 1..steps-1 over 1 + depth*topk keys; a sampled tree
    (drafting/sampled_tree.py) feeds min(topk, that depth's budget) nodes."""
    shapes = {(topk, 1 + depth * topk) for depth in range(1, steps)}
    if sampled:
        budgets = level_budgets(num_nodes, steps, topk)
        for depth, budget in enumerate(budgets[:-1], start=1):
            k = min(topk, budget)
            shapes.add((k, 1 + (depth - 1) * topk + k))
    return shapes


def _add(shapes: Shapes, shape: GraphShape, sizes: list[int]) -> None:
    shapes[shape] = sorted(set(shapes.get(shape, [])) | set(sizes))
