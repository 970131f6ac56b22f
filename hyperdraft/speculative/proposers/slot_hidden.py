"""SlotHidden: an EAGLE head's hidden inputs kept by K/V slot while adaptive step 0 runs as plain decodes.

Adaptive tiers stop drafting at large batches (step 0). A head must still consume the target's hidden state of every
token, which made each such step a round: a one-row verify plus the head's one-token catch-up, 0.49-0.64x of a plain
decode step on an H100 at 64-256 requests (benchmarks/results/step_zero_h100.md), the round's per-request host work
being the cost. Parked, the step is the plain worker's decode (its next decode queued ahead), and the head's input
state of each token it feeds waits here, at the token's K/V slot, until the head drafts for the request again:

  park     a request's first plain step: the states its hidden_buf holds (positions d .. n-1, n = num_computed,
           d = draft_num_computed) move to their slots
  keep     every plain decode, queued ahead or not (a DecodeSink): the head's input state of each fed token, at the
           token's slot; captured inside the step-0 decode graphs (runner/graph_runner.py), where its four eager
           launches cost ~0.2 ms of a 1.9 ms step at 64 requests on an H100
  unpark   the next round of the request: the proposer extends the head over positions d .. n-2 from here, and
           position n-1 becomes hidden_buf's pending entry, as after a prefill chunk

While parked, a request's states for d .. n-1 sit in slots it holds until it finishes or is retracted (retraction
recomputes it through prefill, which forgets the parking). A decode queued ahead and thrown away wrote the state of a
position its request had not committed, or of a slot since released: nothing reads either before a real step of its
owner rewrites it. Sized from the head's own hidden size, one row per K/V slot.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hyperdraft.core.forward_batch import ForwardBatch
from hyperdraft.core.host_copy import to_device
from hyperdraft.kvcache.page_table import PageTable
from hyperdraft.request import Request
from hyperdraft.runner.model_runner import ForwardOutput


class SlotHidden:
    def __init__(self, page_table: PageTable, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 capture_layers: tuple[int, ...], head_inputs: Callable[[ForwardOutput], torch.Tensor]):
        """head_inputs: a target forward's outputs -> the head's input states [T, hidden_size] (EAGLE-3 projects its
        captured layers through fc)."""
        self.page_table = page_table
        self.states = torch.zeros(page_table.num_pages * page_table.page_size, hidden_size, dtype=dtype, device=device)
        self.capture_layers = capture_layers
        self.head_inputs = head_inputs
        self.parked: dict[int, Request] = {}  # page-table row -> the request parked on it

    @staticmethod
    def bytes_per_slot(hidden_size: int, dtype: torch.dtype) -> int:
        return hidden_size * torch.empty((), dtype=dtype).element_size()

    def is_parked(self, req: Request) -> bool:
        return self.parked.get(req.row) is req

    def park(self, reqs: list[Request], hidden_buf: torch.Tensor) -> None:
        """hidden_buf [rows, W, H]: each request's states of positions d .. n-1, pending since its last round."""
        fresh = [r for r in reqs if not self.is_parked(r)]
        if not fresh:
            return
        rows, offsets, index = [], [], []
        for r in fresh:
            pending = r.num_computed - r.draft_num_computed
            rows += [r.row] * pending
            offsets += range(pending)
            index += range(r.draft_num_computed, r.num_computed)
            self.parked[r.row] = r
        rows_t, offsets_t, index_t = to_device(rows + offsets + index, torch.int64, hidden_buf.device).view(3, -1)
        self.states[self.page_table.token_slots(rows_t, index_t)] = hidden_buf[rows_t, offsets_t]

    def keep(self, fb: ForwardBatch, out: ForwardOutput) -> None:
        self.states[fb.out_slots] = self.head_inputs(out)[: fb.num_tokens]

    def unpark(self, reqs: list[Request]) -> list[Request]:
        """The parked requests among reqs, no longer parked: the caller consumes their states now."""
        parked = [r for r in reqs if self.is_parked(r)]
        for r in parked:
            del self.parked[r.row]
        return parked

    def forget(self, reqs: list[Request]) -> None:
        """Requests whose K/V is being recomputed from the start of a prefill chunk: nothing parked stays valid."""
        for r in reqs:
            if self.is_parked(r):
                del self.parked[r.row]

    def gather(self, rows: list[int], index: list[int]) -> torch.Tensor:
        """[len(rows), H]: the states kept at (row, sequence index) pairs."""
        t = to_device(rows + index, torch.int64, self.states.device).view(2, -1)
        return self.states[self.page_table.token_slots(t[0], t[1])]
