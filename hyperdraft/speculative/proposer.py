"""Proposer: the contract every drafter keeps, what it can do, and what it is built from.

A proposer drafts tokens for the decoding requests of a step; the SpecWorker verifies them in one target forward.
Per step it is asked, in this order:

  extend(items, target_hidden)      the target's prefill chunks of this step, so the drafter stays in step with
                                    the target (a draft model runs the same chunks; an EAGLE head consumes the
                                    target's hidden states of them)
  propose(reqs, tier, sampling)     a chain (Proposal) or, for a tree tier, a tree (TreeProposal) per request
  commit(reqs, draft_kv_valid)      after verification: per request, how many accepted nodes past the root still
                                    have the drafter's own K/V (the rest is rewritten by the next round)

Drafters that read the target's hidden states (capabilities.feeds_hidden) also get target_hidden() of every target
forward and, after acceptance, the accepted path's states (store_accepted_hidden). A drafter that can queue the next
round's draft before the host has read this round's results (capabilities.drafts_ahead) gets draft_ahead(). The
worker asks the capabilities, never the object: there is no attribute probing, and nothing is attached to a
proposer after it is built.

Adding a drafter: write one class that subclasses Proposer (which gives no-op defaults for the optional hooks),
is built from (ProposerContext, its draft model) by `build` (by default its constructor) and loads that model in
`load_draft`, then register it under its algorithm names in speculative/proposers/__init__.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch

from hyperdraft.config import EngineArgs
from hyperdraft.core.schedule import ScheduledRequest
from hyperdraft.distributed.tensor_parallel import SINGLE, TensorParallel
from hyperdraft.kvcache.kv_pool import KVPool
from hyperdraft.kvcache.prefix_cache import ParkedHeads
from hyperdraft.options import RuntimeOptions
from hyperdraft.request import Request
from hyperdraft.runner.graph_runner import GraphSettings
from hyperdraft.runner.model_runner import DecodeSink, ForwardOutput, ModelRunner
from hyperdraft.sample.logits_ops import SamplingBatch
from hyperdraft.speculative.adaptive.tier import Tier
from hyperdraft.speculative.config import SpecConfig
from hyperdraft.speculative.metrics import PhaseTimer
from hyperdraft.speculative.proposal import Proposal, TreeProposal

if TYPE_CHECKING:
    from hyperdraft.speculative.graph_plan import CapturePlan


@dataclass(frozen=True)
class ProposerCapabilities:
    """What a proposer can do; the worker and the graph planner read this and nothing else about it."""

    capture_layers: tuple[int, ...] = ()  # target layers whose INPUT states it reads (EAGLE-3's aux states)
    feeds_hidden: bool = False  # reads target hidden states: target_hidden / store_accepted_hidden matter
    compacts_draft_pool: bool = False  # after a tree verify its own K/V of the accepted path moves like the target's
    drafts_ahead: bool = False  # queues the next round's draft before this round's results reach the host
    runs_as_graph: bool = False  # has a draft runner whose steps and whole rounds CUDA graphs capture
    recurrent_state: bool = False  # a hybrid draft model: its state rolls back through accept_draft_state
    # Adaptive step 0 asks nothing of it but to forget a draft queued ahead (discard_ahead): such steps run as the
    # plain worker's decodes, next decode queued ahead included, instead of one-row verify rounds.
    idle_at_step_zero: bool = False
    may_draft_nothing: bool = False  # a round may propose no token for any request (NGRAM finding no match)


@dataclass(frozen=True)
class ProposerContext:
    """Everything a proposer is built from besides its own draft model."""

    spec: SpecConfig
    target: ModelRunner  # the target's runner: its page table (shared by every pool), device and dtype
    attention_backend: str
    graphs: GraphSettings | None  # None: every draft forward runs eagerly
    options: RuntimeOptions
    timer: PhaseTimer
    max_rows: int  # page-table rows: per-request buffers are sized for all of them
    # Step-0 batches of decodes run as the plain worker's decodes, and a drafter that must see every token keeps its
    # inputs from them by slot (speculative/proposers/slot_hidden.py; adaptive tiers, a dense target, park_head on).
    parks_head: bool = False


class Proposer(Protocol):
    supports_trees: ClassVar[bool] = True  # False: the algorithm drafts chains only (the config refuses topk > 1)
    capabilities: ProposerCapabilities
    pool: KVPool | None  # the drafter's own K/V pool, under the target's page table; None when it keeps none

    @classmethod
    def load_draft(cls, spec: SpecConfig, target: torch.nn.Module, args: EngineArgs, device: torch.device,
                   tp: TensorParallel = SINGLE) -> torch.nn.Module | None:
        """The draft model this algorithm runs (None: it needs none), loaded and checked against the target. tp: the
        group a draft that can split is split over (SINGLE: whole on every rank)."""
        return None

    @classmethod
    def parked_bytes_per_slot(cls, draft: torch.nn.Module | None) -> int:
        """Bytes per K/V slot the proposer keeps for parked requests when ProposerContext.parks_head holds."""
        return 0

    @classmethod
    def build(cls, ctx: ProposerContext, draft: torch.nn.Module | None) -> "Proposer":
        """The proposer for this engine, around the draft load_draft returned."""
        return cls(ctx, draft)

    def propose(self, reqs: list[Request], tier: Tier, sampling: SamplingBatch) -> Proposal | TreeProposal:
        """Drafts for the decoding requests: a Proposal for a chain tier, a TreeProposal for a tree tier."""
        ...

    def extend(self, items: list[ScheduledRequest], target_hidden: torch.Tensor | None) -> None:
        """Keep up with the target's prefill chunks of this step (target_hidden: their [T, H] states, in item order,
        when capabilities.feeds_hidden)."""

    def commit(self, reqs: list[Request], draft_kv_valid: list[int]) -> None:
        """After a round that drafted (tier.steps > 0), before the scheduler commits (req.num_computed is still the
        round's n): per request, the accepted nodes past the root whose K/V the drafter itself holds."""

    def target_hidden(self, out: ForwardOutput) -> torch.Tensor | None:
        """What the drafter reads from a target forward (capabilities.feeds_hidden): [T, H] in its own sizes."""
        return None

    def store_accepted_hidden(self, rows: torch.Tensor, accepted_hidden: torch.Tensor) -> None:
        """rows [B]: page-table rows; accepted_hidden [B, D+1, H]: the accepted path's target states, root first."""

    def accept_draft_state(self, rows: torch.Tensor, last_fed: torch.Tensor) -> None:
        """A recurrent draft model: rows [B]; last_fed [B] the scratch entry (its offset past the root, less one) of
        the last accepted node the draft itself fed, -1 for none: that state becomes the committed one."""

    def draft_ahead(self, reqs: list[Request], tier: Tier, sampling: SamplingBatch, num_accepted: torch.Tensor,
                    tokens: torch.Tensor, kept: torch.Tensor | None = None) -> Proposal | TreeProposal | None:
        """Queue the next round's draft from this round's device results (capabilities.drafts_ahead); kept [B]: a tree
        round's accepted nodes whose draft K/V stayed (TreeRound.draft_kv_valid), None after a chain. -> the queued
        proposal, the very object the next propose() returns when it serves that round (so its verify may be queued
        too, verify_ahead.py), or None when nothing was queued."""
        return None

    def ahead_room(self, tier: Tier, batch_size: int) -> int | None:
        """K/V room past a request's n that draft_ahead's queued round for batch_size requests writes
        (capabilities.drafts_ahead), or None."""
        return None

    def discard_ahead(self) -> None:
        """Forget a draft queued ahead (capabilities.drafts_ahead): a step ran without a round; it follows nothing."""

    def decode_sink(self) -> DecodeSink | None:
        """What reads the plain worker's step-0 decodes for the drafter (ProposerContext.parks_head), or None."""
        return None

    def parked_heads(self) -> ParkedHeads | None:
        """Which requests the prefix cache may cache past their draft_num_computed (kvcache/prefix_cache.py), or
        None."""
        return None

    def park(self, reqs: list[Request]) -> None:
        """These decoding requests are about to take a step-0 step as the plain worker's decode (decode_sink reads
        it): whatever the drafter's next round needs moves where that sink keeps it."""

    def flush_history(self) -> None:
        """Forget what earlier requests taught the drafter (flush_cache, as SGLang's resets its n-gram cache): a
        benchmark that repeats its prompts must not be drafted their earlier answers."""

    def capture_graphs(self, plan: CapturePlan) -> None:
        """Capture the draft shapes `plan` can run (capabilities.runs_as_graph)."""

    def release_graphs(self) -> None:
        """Destroy the captured graphs (the engine closes; runner/graph_runner.GraphRunner.release says why)."""
