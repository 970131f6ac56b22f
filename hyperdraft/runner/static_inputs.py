"""GraphShape, what a captured forward is keyed by beside its batch size, and StaticInputs: the input buffers it
reads, for the largest batch of one shape (smaller graphs use leading views), filled from a real batch before each
replay (runner/graph_runner.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyperdraft.core.forward_batch import ForwardBatch


@dataclass(frozen=True, order=True)
class GraphShape:
    tokens_per_req: int  # q: 1 for decode, the verify width for target verify, the frontier size of a tree draft step
    mask_width: int  # W of the [B, q, W] tail mask; 0 = plain causal (no mask)
    # False: logits for every token. True: one logits row per request, at fb.logits_indices (a static [B] buffer
    # refilled per replay): the draft extend, whose requests feed 1..q real tokens and are padded to q.
    one_logit: bool = False


class StaticInputs:
    """Input buffers for the largest batch of one GraphShape; smaller graphs use leading views."""

    def __init__(self, shape: GraphShape, max_bs: int, device, hidden_size: int | None, dtype: torch.dtype,
                 recurrent: bool):
        """recurrent: a hybrid target's graphs, which read the state walk buffers (a dense model's never do, so its
        fills skip them: two launches of a decode step's seven on the host's critical path)."""
        q, n = shape.tokens_per_req, max_bs * shape.tokens_per_req
        self.recurrent = recurrent
        # Sized from the model that consumes it (a head's hidden size is not the target's).
        self.input_hidden = torch.zeros(n, hidden_size, dtype=dtype, device=device) if hidden_size else None
        as_long = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(n, **as_long)
        self.positions = torch.zeros(n, **as_long)
        self.out_slots = torch.zeros(n, **as_long)
        self.req_rows = torch.zeros(max_bs, **as_long)
        self.seq_lens = torch.full((max_bs,), q, dtype=torch.int32, device=device)
        self.extend_starts = torch.arange(0, n, q, dtype=torch.int32, device=device)
        self.extend_lens = torch.full((max_bs,), q, dtype=torch.int32, device=device)
        self.one_logit = shape.one_logit
        # every token's row (never refilled), or one row per request: each request's last token until filled
        self.default_logits = torch.arange(q - 1, n, q, **as_long) if shape.one_logit else None
        self.logits_indices = self.default_logits.clone() if shape.one_logit else torch.arange(n, **as_long)
        # a hybrid target's verify: token j of each row starts from token j-1's state (a tree's parents are filled in)
        self.chain_parents = (torch.arange(n, **as_long) % q) - 1
        self.state_parents = self.chain_parents.clone()
        # a hybrid target's one-token decode: each row's state source and destination (-1 / -1: its slot, in place)
        self.state_targets = torch.full((n,), -1, **as_long) if q == 1 else None
        self.tail_mask = None
        if shape.mask_width:
            self.causal_rows = torch.ones(q, shape.mask_width, dtype=torch.bool, device=device).tril(shape.mask_width - q)
            self.tail_mask = self.causal_rows.repeat(max_bs, 1, 1)

    def batch(self, mode, bs: int, q: int, max_seq_len: int, prefix_lens: list[int],
              speculative: bool = False) -> ForwardBatch:
        n = bs * q
        return ForwardBatch(
            mode=mode, input_ids=self.input_ids[:n], positions=self.positions[:n], out_slots=self.out_slots[:n],
            req_rows=self.req_rows[:bs], prefix_lens=prefix_lens, extend_lens=[q] * bs,
            logits_indices=self.logits_indices[: bs if self.one_logit else n],
            tail_mask=None if self.tail_mask is None else self.tail_mask[:bs],
            seq_lens_t=self.seq_lens[:bs], extend_starts_t=self.extend_starts[:bs], extend_lens_t=self.extend_lens[:bs],
            max_extend_len=q, max_seq_len=max_seq_len,
            input_hidden=None if self.input_hidden is None else self.input_hidden[:n], logits_every_row=not self.one_logit,
            state_parents=self.state_parents[:n] if speculative else None, num_spec_requests=bs if speculative else 0,
            state_targets=self.state_targets[:n] if speculative and self.state_targets is not None else None,
        )

    def _fill_state_walk(self, fb: ForwardBatch, n: int) -> None:
        if fb.state_parents is not None:
            self.state_parents[:n].copy_(fb.state_parents[:n])
        elif self.state_targets is not None:  # a decode whose states stay in their slots
            self.state_parents[:n].fill_(-1)
        if self.state_targets is not None:
            if fb.state_targets is not None:
                self.state_targets[:n].copy_(fb.state_targets[:n])
            else:
                self.state_targets[:n].fill_(-1)

    def fill(self, fb: ForwardBatch, bs: int, q: int) -> None:
        """Copy the real batch in and reset the padding rows (device-to-device copies, no sync)."""
        real, n = fb.batch_size, fb.batch_size * q
        self.input_ids[:n].copy_(fb.input_ids)
        self.positions[:n].copy_(fb.positions)
        self.out_slots[:n].copy_(fb.out_slots)
        self.req_rows[:real].copy_(fb.req_rows)
        self.seq_lens[:real].copy_(fb.seq_lens_t)
        if fb.tail_mask is not None:
            self.tail_mask[:real].copy_(fb.tail_mask)
        if self.recurrent:
            self._fill_state_walk(fb, n)
        if self.input_hidden is not None:
            self.input_hidden[:n].copy_(fb.input_hidden)
        if self.one_logit:
            self.logits_indices[:real].copy_(fb.logits_indices)
        if bs > real:
            self.input_ids[n : bs * q].zero_()
            self.positions[n : bs * q].zero_()
            self.out_slots[n : bs * q].zero_()  # padding writes land in the padding page, never a real slot
            self.req_rows[real:bs].zero_()
            if self.input_hidden is not None:
                self.input_hidden[n : bs * q].zero_()
            self.seq_lens[real:bs].fill_(q)
            if self.recurrent:
                self.state_parents[n : bs * q].copy_(self.chain_parents[n : bs * q])
                if self.state_targets is not None:
                    self.state_targets[n : bs * q].fill_(-1)
            if self.one_logit:
                self.logits_indices[real:bs].copy_(self.default_logits[real:bs])
            if self.tail_mask is not None:
                self.tail_mask[real:bs] = self.causal_rows
