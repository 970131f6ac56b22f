"""The state backend of a hybrid model's Gated DeltaNet layers: what the K/V attention backend is to full attention.

A layer hands it q|k|v before the conv and the gate inputs (GdnGates) for every packed token; per request it runs the
causal conv and the gated delta rule from the request's state and returns the recurrence's output. Where states come
from and go:
  a request that advances  its committed slot (StatePool.conv / recurrent): read, then overwritten; a request whose
                           first chunk this is (prefix 0) starts from zeros, whatever its slot held before
  a speculative request    (the first fb.num_spec_requests: a verify's rows) token j starts from its parent's state
                           (fb.state_parents; -1: the committed one) and writes its own to scratch [slot, j]; the
                           committed slot is untouched until StatePool.commit. fb.state_targets, when given, names
                           each token's destination instead (-1: the committed slot), as a plain decode queued
                           ahead alternates a request's state between its slot and scratch entry 0
  a padding request        (a captured graph's padding rows: no real K/V slot) slot 0, which belongs to no one

TorchLinearBackend is the reference (and the CPU path); it reads the batch's host lists. TritonLinearBackend (CUDA)
plans on the device without a host copy and runs two kernels a layer (kernels/gated_delta_walk.py): the conv walk,
which writes every token's window where its state goes, and the delta walk, which keeps a chain's state in registers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyperdraft.core.forward_batch import ForwardBatch
from hyperdraft.kernels.gated_delta import GdnGates, causal_conv_step, delta_step, prepare_qkv
from hyperdraft.kernels.gated_delta_walk import Walk, conv_walk, delta_walk
from hyperdraft.kvcache.state_pool import StatePool


@dataclass
class LinearPlan:
    starts: list[int]  # packed row of each request's first token
    lens: list[int]  # tokens per request
    slots: list[int]  # state slot per request (0: padding)
    fresh: list[bool]  # the request's first tokens: its state starts from zeros
    num_spec: int  # the first num_spec requests are speculative
    parents: list[list[int]]  # per speculative request, each token's parent (-1: the committed state)
    targets: list[list[int]]  # per speculative request, the scratch index each token's state goes to


class TorchLinearBackend:
    """Speculative requests run one verify token at a time, batched over the requests; single-token decodes run
    batched too; multi-token chunks (prefill) one request at a time."""

    def __init__(self, pool: StatePool):
        self.pool = pool
        self.cfg = pool.cfg

    def plan(self, fb: ForwardBatch) -> LinearPlan:
        live = fb.out_slots[fb.extend_starts_t.long()] != 0  # a padding row's tokens write only the padding page
        slots = torch.where(live, fb.req_rows + 1, 0).tolist()
        starts = fb.extend_starts_t.tolist()
        parents, targets = [], []
        if fb.num_spec_requests:
            spans = list(zip(starts, fb.extend_lens[: fb.num_spec_requests]))
            flat = fb.state_parents.tolist()
            parents = [flat[s : s + n] for s, n in spans]
            flat = fb.state_targets.tolist() if fb.state_targets is not None else None
            targets = [flat[s : s + n] if flat is not None else list(range(n)) for s, n in spans]
        return LinearPlan(starts, list(fb.extend_lens), slots, [p == 0 for p in fb.prefix_lens],
                          fb.num_spec_requests, parents, targets)

    def forward(self, layer: int, mixed: torch.Tensor, gates: GdnGates, conv_weight: torch.Tensor,
                plan: LinearPlan) -> torch.Tensor:
        """mixed [T, C], conv_weight [C, K] -> [T, HV, dv] in mixed's dtype."""
        cfg = self.cfg
        g, beta = gates.decay_and_beta()
        out = torch.zeros(mixed.shape[0], cfg.num_v_heads, cfg.v_head_dim, dtype=mixed.dtype, device=mixed.device)
        if plan.num_spec:
            self._speculative(layer, plan, mixed, g, beta, conv_weight, out)
        if plan.num_spec < len(plan.lens):
            self._advance(layer, plan, mixed, g, beta, conv_weight, out)
        return out

    def _advance(self, layer, plan: LinearPlan, mixed, g, beta, weight, out) -> None:
        """The non-speculative requests, token j of every one at once, from their committed states (zeros for a
        first chunk) back into them."""
        pool, device = self.pool, mixed.device
        reqs = list(range(plan.num_spec, len(plan.lens)))
        slots = torch.tensor([plan.slots[b] for b in reqs], device=device)
        fresh = torch.tensor([plan.fresh[b] for b in reqs], device=device)
        conv_state = torch.where(fresh[:, None, None], 0, pool.conv[layer, slots])
        state = torch.where(fresh[:, None, None, None], 0, pool.recurrent[layer, slots].float())
        lens = torch.tensor([plan.lens[b] for b in reqs], device=device)
        starts = torch.tensor([plan.starts[b] for b in reqs], device=device)
        for j in range(max(plan.lens[b] for b in reqs)):
            active = (lens > j).nonzero()[:, 0] if j else torch.arange(len(reqs), device=device)
            rows = starts[active] + j
            conv_out, conv_state[active] = causal_conv_step(mixed[rows], conv_state[active], weight)
            o, state[active] = delta_step(state[active], *self._qkv(conv_out), g[rows], beta[rows])
            out[rows] = o.to(out.dtype)
        pool.conv[layer, slots] = conv_state
        pool.recurrent[layer, slots] = state.to(pool.recurrent.dtype)

    def _speculative(self, layer, plan: LinearPlan, mixed, g, beta, weight, out) -> None:
        """Token j of every speculative request at once: from its parent's state (scratch, or the committed one for
        -1) into its target (scratch j for a verify; -1: the committed slot)."""
        pool, device = self.pool, mixed.device
        for j in range(max(plan.lens[: plan.num_spec])):
            reqs = [b for b in range(plan.num_spec) if plan.lens[b] > j]
            rows = torch.tensor([plan.starts[b] + j for b in reqs], device=device)
            slots = torch.tensor([plan.slots[b] for b in reqs], device=device)
            parent = torch.tensor([plan.parents[b][j] for b in reqs], device=device)
            target = torch.tensor([plan.targets[b][j] for b in reqs], device=device)
            conv_state, state = pool.conv[layer, slots], pool.recurrent[layer, slots].float()
            if j == 0 and any(plan.fresh[b] and plan.targets[b][0] < 0 for b in reqs):
                # a first chunk routed here (a graph-shaped batch) starts from zeros, not from what the slot's last
                # occupant left: the rule of _advance, the walk kernels and walk_reference
                fresh = torch.tensor([plan.fresh[b] and plan.targets[b][0] < 0 for b in reqs], device=device)
                conv_state = torch.where(fresh[:, None, None], 0, conv_state)
                state = torch.where(fresh[:, None, None, None], 0, state)
            if any(plan.parents[b][j] >= 0 for b in reqs):  # (a plain engine's decodes may have no scratch at all)
                from_scratch = (parent >= 0)[:, None, None]
                conv_state = torch.where(from_scratch, pool.conv_scratch[layer, slots, parent.clamp_min(0)], conv_state)
                state = torch.where(from_scratch[..., None], pool.recurrent_scratch[layer, slots, parent.clamp_min(0)],
                                    state.to(pool.recurrent_scratch.dtype)).float()
            conv_out, conv_state = causal_conv_step(mixed[rows], conv_state, weight)
            o, state = delta_step(state, *self._qkv(conv_out), g[rows], beta[rows])
            self._store(layer, slots, target, conv_state, state)
            out[rows] = o.to(out.dtype)

    def _store(self, layer: int, slots, target, conv_state, state) -> None:
        """Each token's new states to its target: a scratch entry, or (-1) the committed slot."""
        pool, to_slot = self.pool, target < 0
        to_scratch = ~to_slot
        pool.conv[layer, slots[to_slot]] = conv_state[to_slot]
        pool.recurrent[layer, slots[to_slot]] = state[to_slot].to(pool.recurrent.dtype)
        pool.conv_scratch[layer, slots[to_scratch], target[to_scratch]] = conv_state[to_scratch]
        pool.recurrent_scratch[layer, slots[to_scratch], target[to_scratch]] = state[to_scratch].to(pool.recurrent_scratch.dtype)

    def _qkv(self, conv_out: torch.Tensor):
        cfg = self.cfg
        return prepare_qkv(conv_out, cfg.key_dim, cfg.k_head_dim, cfg.num_v_heads, cfg.v_head_dim)


def plan_walk(fb: ForwardBatch) -> Walk:
    """The batch's walk (kernels/gated_delta_walk.py's terms), built on the device: speculative tokens take their
    parents and targets from the batch, every other request's first token reads its slot (zeros when fresh) and the
    rest continue from the token before."""
    device, num_tokens, num_reqs = fb.input_ids.device, fb.input_ids.shape[0], len(fb.extend_lens)
    starts = fb.extend_starts_t.to(torch.int32)
    lens = fb.extend_lens_t.to(torch.int32)
    live = fb.out_slots[starts.long()] != 0  # a padding row's tokens write only the padding page
    slots = torch.where(live, fb.req_rows + 1, 0)
    fresh = (fb.seq_lens_t == fb.extend_lens_t).to(torch.int32)  # nothing before these tokens (device: capturable)
    parent = torch.full((num_tokens,), -2, dtype=torch.int32, device=device)
    parent.index_fill_(0, starts.long(), -1)  # (a scalar index_put would copy from the host: not capturable)
    target = torch.full((num_tokens,), -1, dtype=torch.int32, device=device)
    spec_tokens = sum(fb.extend_lens[: fb.num_spec_requests])
    if spec_tokens:
        parent[:spec_tokens] = fb.state_parents[:spec_tokens].to(torch.int32)
        if fb.state_targets is not None:
            target[:spec_tokens] = fb.state_targets[:spec_tokens].to(torch.int32)
        else:  # a verify: token j of its request goes to scratch j
            first = torch.repeat_interleave(starts[: fb.num_spec_requests], lens[: fb.num_spec_requests],
                                            output_size=spec_tokens)
            target[:spec_tokens] = torch.arange(spec_tokens, dtype=torch.int32, device=device) - first
    return Walk(num_reqs, starts, lens, slots, fresh, parent, target)


class TritonLinearBackend:
    """The CUDA backend: the same states read and written as TorchLinearBackend's, two launches a layer."""

    def __init__(self, pool: StatePool):
        self.pool = pool
        self.cfg = pool.cfg

    def plan(self, fb: ForwardBatch) -> Walk:
        return plan_walk(fb)

    def forward(self, layer: int, mixed: torch.Tensor, gates: GdnGates, conv_weight: torch.Tensor,
                walk: Walk) -> torch.Tensor:
        """mixed [T, C], conv_weight [C, K] -> [T, HV, dv] in mixed's dtype."""
        pool = self.pool
        qkv = conv_walk(mixed, conv_weight, pool.conv[layer], pool.conv_scratch[layer], walk)
        return delta_walk(qkv, gates, pool.recurrent[layer], pool.recurrent_scratch[layer], walk, self.cfg.key_dim,
                          mixed.dtype)
