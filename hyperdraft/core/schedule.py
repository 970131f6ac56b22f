"""What the scheduler hands a worker, and what a worker hands back: one step's batch and per-request results."""

from __future__ import annotations

from dataclasses import dataclass, field

from hyperdraft.core.forward_batch import ForwardInput
from hyperdraft.request import Request


@dataclass
class ScheduledRequest:
    req: Request
    num_tokens: int  # uncomputed tokens fed this step
    samples: bool  # the chunk reaches the end of the sequence, so the step yields a token

    def forward_input(self) -> ForwardInput:
        """The request's next num_tokens uncomputed tokens, with a logits row when the step samples."""
        req = self.req
        tokens = req.token_ids(req.num_computed, req.num_computed + self.num_tokens)
        return ForwardInput(req.row, req.num_computed, tokens, num_logits=1 if self.samples else 0)


@dataclass
class ScheduledBatch:
    """One step's work: num_decodes decodes (requests whose newest token alone lacks K/V, Request.is_decoding), then
    prefill chunks. The scheduler counts them; the workers and the commit take the two lists from here instead of
    classifying each item again: at 256 requests those five walks cost 85 us a step on a 2-core CPU (timeit), the
    split here 7."""

    items: list[ScheduledRequest]
    num_decodes: int
    decodes: list[ScheduledRequest] = field(init=False)
    prefills: list[ScheduledRequest] = field(init=False)

    def __post_init__(self):
        self.decodes, self.prefills = self.items[: self.num_decodes], self.items[self.num_decodes:]


@dataclass
class RequestResult:
    """What one step did for one request."""

    num_committed: int  # tokens whose K/V is now final (fed tokens, or last token + accepted drafts)
    new_tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    num_drafted: int | None = None  # draft tokens verified this step; None when the step was no verify
    num_accepted: int = 0  # of those, accepted by verification
    keeps_room: bool = False  # a plain decode step or a step-0 round: its room past num_committed stays (work queued
    # ahead wrote there)


@dataclass
class StepOutput:
    req: Request
    new_token_ids: list[int]
    finished: bool
