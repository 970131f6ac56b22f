"""What a verify round (chain.py, tree.py) is built from and what it decodes to.

A round lives for one engine step: built from the proposal, it gives the target forward its rows (inputs,
packed_ids, positions, tail_mask), decides acceptance on the device (accept), names the pieces the step's one
device-to-host copy carries (pieces), and decodes them on the host (decode: a pure function of the host values).
Commit and metrics are the worker's explicit calls on the RoundOutcome.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from hyperdraft.core.schedule import RequestResult
from hyperdraft.request import Request
from hyperdraft.runner.model_runner import ModelRunner
from hyperdraft.speculative.proposer import Proposer


@dataclass(frozen=True)
class RoundContext:
    target: ModelRunner
    proposer: Proposer
    simulate_accept_rate: float | None  # benchmark-only, lossy (simulated.py); None = verify
    coupled: bool  # sampled rows verified against the target's keyed sample (coupled.py), else by rejection
    simulate_sibling_rate: float | None = None  # simulated trees: a lower-ranked child's chance (simulated.py)


class RoundOutcome(NamedTuple):
    """A verified round, decoded on the host."""

    results: list[RequestResult]  # per request: tokens to append (accepted drafts, then the recovered/bonus token)
    num_accepted: list[int]  # draft tokens accepted per request
    num_drafted: list[int]  # draft tokens verified per request
    depth: list[int]  # draft depth offered per request (acceptance by position counts the positions below it)
    draft_kv_valid: list[int]  # accepted nodes past the root whose K/V the drafter holds (Proposer.commit)


def reserved_room(target: ModelRunner, reqs: list[Request]) -> list[int]:
    """Tokens past the last committed one that each row has reserved (narrower than a full round only when a lone
    request fills the pool): never draft or verify past it."""
    return [target.page_table.num_slots(r.row) - r.num_computed - 1 for r in reqs]


def logprob_rows(logprobs: list[list[float]] | None, num_rows: int) -> list[list[float]]:
    """A round's per-request logprobs as the host copy brought them; empty lists when no request asked for any."""
    return logprobs if logprobs is not None else [[]] * num_rows


def last_token(req: Request) -> int:
    return req.output_ids[-1] if req.output_ids else req.prompt_ids[-1]
