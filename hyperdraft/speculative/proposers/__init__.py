"""The proposer registry: every speculative algorithm name (hyperdraft.config.SPECULATIVE_ALGORITHMS) -> its class.

Adding a drafter is one class (see speculative/proposer.py) and one line here."""

from __future__ import annotations

from hyperdraft.speculative.proposer import Proposer
from hyperdraft.speculative.proposers.draft_model import DraftModelProposer
from hyperdraft.speculative.proposers.eagle import EagleProposer
from hyperdraft.speculative.proposers.ngram import NgramProposer

PROPOSERS: dict[str, type[Proposer]] = {
    "NGRAM": NgramProposer,
    "STANDALONE": DraftModelProposer,
    "EAGLE": EagleProposer,
    "EAGLE3": EagleProposer,
}


def proposer_class(algorithm: str) -> type[Proposer]:
    """The class registered for a resolved algorithm name (SpecConfig.algorithm)."""
    return PROPOSERS[algorithm]
