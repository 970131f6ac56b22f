"""The state backend of a hybrid model's Gated DeltaNet layers: what the K/V attention backend is to full attention.

A layer hands it q|k|v before the conv, g and beta for every packed token; per request it runs the causal conv and
the gated delta rule from the request's state and returns the recurrence's output. Where states come from and go:
  a request that advances  its committed slot (StatePool.conv / recurrent): read, then overwritten; a request whose
                           first chunk this is (prefix 0) starts from zeros, whatever its slot held before
  a speculative request    (the first fb.num_spec_requests: a verify's rows) token j starts from its parent's state
                           (fb.state_parents; -1: the committed one) and writes its own to scratch [slot, j]; the
                           committed slot is untouched until StatePool.commit
  a padding request        (a captured graph's padding rows: no real K/V slot) slot 0, which belongs to no one

TorchLinearBackend is the reference (and the CPU path); it reads the batch's host lists.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyperdraft.core.forward_batch import ForwardBatch
from hyperdraft.kernels.gated_delta import causal_conv_step, delta_step, prepare_qkv
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

    def forward(self, layer: int, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv_weight: torch.Tensor,
                plan: LinearPlan) -> torch.Tensor:
        """mixed [T, C], g [T, HV] fp32, beta [T, HV], conv_weight [C, K] -> [T, HV, dv] in mixed's dtype."""
        cfg = self.cfg
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
        -1) into its target's scratch (j for a verify)."""
        pool, device = self.pool, mixed.device
        for j in range(max(plan.lens[: plan.num_spec])):
            reqs = [b for b in range(plan.num_spec) if plan.lens[b] > j]
            rows = torch.tensor([plan.starts[b] + j for b in reqs], device=device)
            slots = torch.tensor([plan.slots[b] for b in reqs], device=device)
            parent = torch.tensor([plan.parents[b][j] for b in reqs], device=device)
            target = torch.tensor([plan.targets[b][j] for b in reqs], device=device)
            from_scratch = (parent >= 0)[:, None, None]
            conv_state = torch.where(from_scratch, pool.conv_scratch[layer, slots, parent.clamp_min(0)],
                                     pool.conv[layer, slots])
            state = torch.where(from_scratch[..., None], pool.recurrent_scratch[layer, slots, parent.clamp_min(0)],
                                pool.recurrent[layer, slots]).float()
            conv_out, pool.conv_scratch[layer, slots, target] = causal_conv_step(mixed[rows], conv_state, weight)
            o, state = delta_step(state, *self._qkv(conv_out), g[rows], beta[rows])
            pool.recurrent_scratch[layer, slots, target] = state.to(pool.recurrent_scratch.dtype)
            out[rows] = o.to(out.dtype)

    def _qkv(self, conv_out: torch.Tensor):
        cfg = self.cfg
        return prepare_qkv(conv_out, cfg.key_dim, cfg.k_head_dim, cfg.num_v_heads, cfg.v_head_dim)
