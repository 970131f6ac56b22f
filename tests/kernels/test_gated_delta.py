"""kernels/gated_delta.py, the torch reference of the Gated DeltaNet's stateful pieces, against transformers' own
torch implementations (which run whenever fla and causal_conv1d are not installed), including a non-zero initial
state; and the one-token conv against the whole-chunk conv."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import (torch_chunk_gated_delta_rule,
                                                          torch_recurrent_gated_delta_rule)

from hyperdraft.kernels.gated_delta import causal_conv, causal_conv_step, delta_step, gated_delta_rule, prepare_qkv

HK, HV, DK, DV, K, N = 2, 4, 16, 8, 4, 11


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    mixed = torch.randn(N, 2 * HK * DK + HV * DV, generator=g)
    decay = -torch.rand(N, HV, generator=g) * 2  # log decays <= 0
    beta = torch.rand(N, HV, generator=g)
    state = torch.randn(HV, DK, DV, generator=g) * 0.3
    return mixed, decay, beta, state


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_rule_equals_transformers(seed):
    mixed, decay, beta, state = _inputs(seed)
    q, k, v = prepare_qkv(mixed, HK * DK, DK, HV, DV)
    ours, final = gated_delta_rule(q, k, v, decay, beta, state)
    # transformers takes unnormalised q/k per key head and normalises (and scales) inside
    raw_q, raw_k, raw_v = mixed.split([HK * DK, HK * DK, HV * DV], dim=-1)
    args = (raw_q.view(1, N, HK, DK), raw_k.view(1, N, HK, DK), raw_v.view(1, N, HV, DV), decay[None], beta[None])
    for fn in (torch_recurrent_gated_delta_rule, torch_chunk_gated_delta_rule):
        theirs, their_final = fn(*args, initial_state=state[None], output_final_state=True,
                                 use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(ours, theirs[0], atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(final, their_final[0], atol=2e-5, rtol=2e-5)


def test_batched_steps_are_each_requests_own():
    """delta_step over a batch gives every request exactly (bitwise) what it gets alone."""
    rows = [_inputs(s) for s in range(3)]
    qkv = [prepare_qkv(m[:1], HK * DK, DK, HV, DV) for m, _, _, _ in rows]
    alone = [delta_step(st, q[0], k[0], v[0], d[0], b[0]) for (m, d, b, st), (q, k, v) in zip(rows, qkv)]
    batched = delta_step(torch.stack([st for *_, st in rows]), *(torch.cat(x) for x in zip(*qkv)),
                         torch.stack([d[0] for _, d, _, _ in rows]), torch.stack([b[0] for _, _, b, _ in rows]))
    for i, (o, s) in enumerate(alone):
        assert torch.equal(batched[0][i], o) and torch.equal(batched[1][i], s)


def test_one_token_convs_chain_into_the_chunk_conv():
    mixed = torch.randn(N, 24)
    weight, state = torch.randn(24, K), torch.randn(24, K - 1)
    whole, whole_state = causal_conv(mixed, state, weight)
    conv_state, outs = state[None], []
    for t in range(N):
        out, conv_state = causal_conv_step(mixed[t : t + 1], conv_state, weight)
        outs.append(out[0])
    torch.testing.assert_close(torch.stack(outs), whole, atol=1e-6, rtol=1e-6)
    assert torch.equal(conv_state[0], whole_state)
