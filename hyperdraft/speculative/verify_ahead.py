"""VerifyAhead: the next step-0 round's verify, queued before the host waits for this round's results.

A round at step 0 (adaptive tiers give it to large batches: 64 requests and up on SGLang's default ladder) drafts
nothing, so its verify is one row per request, [last token], the shape of a plain decode. For a drafter that must
see every token (an EAGLE head's catch-up feeds on the target's hidden states) it cannot run as the plain worker's
step (speculative/worker.py), and without this the GPU idles while the host commits. Measured on an H100 with the
SmolLM2 shape (benchmarks/results/step_zero_h100.md): at 64 requests a step-0 round took 2847 us without it and 2136
with it (plain decoding: 1292); at 128 and 256 requests the round is host-bound (about 20 us of host work per
request) and it changes nothing beyond the spread. Where the verify outlasts the host (a larger target) it should
hide the host's whole step, as decode-ahead does for plain decoding; not yet measured there.

Such a round's output token is on the device before the host reads it, so the next verify's input is known: this
queues it (the same TARGET_VERIFY batch a round would build, one index further, a captured graph) right after the
round's results copy. The next step uses its outputs when it is again a step-0 round of decodes over the same
requests; otherwise they are dropped. Dropping is harmless: the queued forward wrote only the target K/V of each
request's committed next token at its own next index (what the next verify writes anyway), in room reserved when it
was queued and kept through the commit (a step-0 round keeps its room, as a plain step does), or in a finished
request's released slots before their next owner writes them (one stream).

Not for hybrid targets: their recurrent state would need the plain worker's two-location walk.
"""

from __future__ import annotations

from dataclasses import dataclass

from hyperdraft.core.forward_batch import ForwardMode
from hyperdraft.request import Request, same_requests
from hyperdraft.runner.graph_runner import GraphShape
from hyperdraft.runner.model_runner import ForwardOutput, ModelRunner
from hyperdraft.runner.next_token import next_token_batch
from hyperdraft.speculative.verify.chain import ChainRound


@dataclass(frozen=True)
class QueuedVerify:
    reqs: list[Request]
    out: ForwardOutput  # views of the graph's output buffers: valid until the target's next forward of this shape


class VerifyAhead:
    def __init__(self, runner: ModelRunner, capture_layers: tuple[int, ...], enabled: bool):
        """enabled: RuntimeOptions.decode_ahead, and a target without recurrent state (module doc)."""
        self.runner, self.capture_layers = runner, capture_layers
        self.enabled = enabled and runner.state_pool is None
        self.queued: QueuedVerify | None = None
        self.used = 0  # steps served by a queued verify, and queued verifies dropped (tests, benchmarks)
        self.dropped = 0

    def take(self, round_: ChainRound | None, with_prefills: bool) -> ForwardOutput | None:
        """The queued verify's outputs when this step is a step-0 round of decodes over the same requests; None (and
        the queued one dropped) otherwise. Called on every step: a queued verify never outlives the step after it."""
        queued, self.queued = self.queued, None
        if queued is None:
            return None
        serves = (round_ is not None and not with_prefills and round_.tier.steps == 0
                  and same_requests(round_.reqs, queued.reqs))
        if serves:
            self.used += 1
            return queued.out
        self.dropped += 1
        return None

    def discard(self) -> None:
        self.dropped += self.queued is not None
        self.queued = None

    def queue(self, round_: ChainRound) -> None:
        """After a step-0 round of decodes only, before the scheduler commits it (req.num_computed is still n): verify
        each request's output token (round_.tokens[:, 0], on the device) at index n + 1, if a graph runs it."""
        reqs, graphs, table = round_.reqs, self.runner.graphs, self.runner.page_table
        if not self.enabled or round_.tier.steps != 0 or graphs is None or not graphs.fits(GraphShape(1, 0), len(reqs)):
            return
        fb = next_token_batch(ForwardMode.TARGET_VERIFY, reqs, round_.tokens[:, 0], table, self.runner.device)
        if fb is None:
            return
        self.queued = QueuedVerify(reqs, self.runner.forward(fb, capture_layers=self.capture_layers))
