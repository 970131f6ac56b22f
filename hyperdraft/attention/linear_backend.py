"""The state backend of a hybrid model's Gated DeltaNet layers: what the K/V attention backend is to full attention.

A layer hands it q|k|v before the conv, g and beta for every packed token; per request it runs the causal conv and
the gated delta rule from the request's state and returns the recurrence's output. Where states come from and go:
  a request that advances  its committed slot (StatePool.conv / recurrent): read, then overwritten; a request whose
                           first chunk this is (prefix 0) starts from zeros, whatever its slot held before
  a speculative request    (the first fb.num_spec_requests: a verify's rows) token j starts from its parent's state
                           (fb.state_parents; -1: the committed one) and writes its own to scratch [slot, j]; the
                           committed slot is untouched until StatePool.commit
  a padding request        (a captured graph's padding rows: no real K/V slot) slot 0, which belongs to no one

TorchLinearBackend is the reference (and the CPU path): a Python loop over requests and, for speculative tokens, over
tokens, reading the batch's host lists.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyperdraft.core.forward_batch import ForwardBatch
from hyperdraft.kernels.gated_delta import causal_conv, delta_step, gated_delta_rule, prepare_qkv
from hyperdraft.kvcache.state_pool import StatePool


@dataclass
class LinearPlan:
    starts: list[int]  # packed row of each request's first token
    lens: list[int]  # tokens per request
    slots: list[int]  # state slot per request (0: padding)
    fresh: list[bool]  # the request's first tokens: its state starts from zeros
    parents: list[list[int]]  # per speculative request (the first ones), each token's parent (-1: committed state)


class TorchLinearBackend:
    def __init__(self, pool: StatePool):
        self.pool = pool
        self.cfg = pool.cfg

    def plan(self, fb: ForwardBatch) -> LinearPlan:
        live = fb.out_slots[fb.extend_starts_t.long()] != 0  # a padding row's tokens write only the padding page
        slots = torch.where(live, fb.req_rows + 1, 0).tolist()
        starts = fb.extend_starts_t.tolist()
        parents = []
        if fb.num_spec_requests:
            flat = fb.state_parents.tolist()
            parents = [flat[s : s + n] for s, n in zip(starts, fb.extend_lens[: fb.num_spec_requests])]
        return LinearPlan(starts, list(fb.extend_lens), slots, [p == 0 for p in fb.prefix_lens], parents)

    def forward(self, layer: int, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv_weight: torch.Tensor,
                plan: LinearPlan) -> torch.Tensor:
        """mixed [T, C], g [T, HV] fp32, beta [T, HV], conv_weight [C, K] -> [T, HV, dv] in mixed's dtype."""
        cfg = self.cfg
        out = torch.zeros(mixed.shape[0], cfg.num_v_heads, cfg.v_head_dim, dtype=mixed.dtype, device=mixed.device)
        for b, (start, n, slot) in enumerate(zip(plan.starts, plan.lens, plan.slots)):
            rows = slice(start, start + n)
            if b < len(plan.parents):
                out[rows] = self._speculative(layer, slot, plan.parents[b], mixed[rows], g[rows], beta[rows], conv_weight)
            else:
                out[rows] = self._advance(layer, slot, plan.fresh[b], mixed[rows], g[rows], beta[rows], conv_weight)
        return out

    def _advance(self, layer, slot, fresh, mixed, g, beta, weight) -> torch.Tensor:
        pool = self.pool
        conv_state, state = pool.conv[layer, slot], pool.recurrent[layer, slot].float()
        if fresh:
            conv_state, state = torch.zeros_like(conv_state), torch.zeros_like(state)
        conv_out, pool.conv[layer, slot] = causal_conv(mixed, conv_state, weight)
        o, state = gated_delta_rule(*self._qkv(conv_out), g, beta, state)
        pool.recurrent[layer, slot] = state
        return o.to(mixed.dtype)

    def _speculative(self, layer, slot, parents, mixed, g, beta, weight) -> torch.Tensor:
        pool = self.pool
        o = torch.empty(mixed.shape[0], self.cfg.num_v_heads, self.cfg.v_head_dim, dtype=torch.float32,
                        device=mixed.device)
        for j, p in enumerate(parents):
            conv_state = pool.conv[layer, slot] if p < 0 else pool.conv_scratch[layer, slot, p]
            state = (pool.recurrent[layer, slot] if p < 0 else pool.recurrent_scratch[layer, slot, p]).float()
            conv_out, pool.conv_scratch[layer, slot, j] = causal_conv(mixed[j : j + 1], conv_state, weight)
            q, k, v = self._qkv(conv_out)
            o[j], state = delta_step(state, q[0], k[0], v[0], g[j], beta[j])
            pool.recurrent_scratch[layer, slot, j] = state
        return o.to(mixed.dtype)

    def _qkv(self, conv_out: torch.Tensor):
        cfg = self.cfg
        return prepare_qkv(conv_out, cfg.key_dim, cfg.k_head_dim, cfg.num_v_heads, cfg.v_head_dim)
