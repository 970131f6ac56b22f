"""Triton kernels for a Gated DeltaNet layer's stateful half, in one pass over a packed batch whatever it holds:
prefill chunks, decodes and speculative verifies side by side. Beside each: walk_reference, the same walk in torch.

Terms (per request b, its tokens rows start[b] .. start[b] + len[b] - 1, token j of it):
  slot      the request's committed state (StatePool.conv / .recurrent [L, S, ...]); 0 for padding rows
  fresh     the request's first chunk: its first token starts from zeros, not from its slot
  parent[t] -2: the previous token of the same request (a prefill chunk or a decode)
            -1: the committed state (a verify's root, a draft step fed from the committed state)
            p >= 0: scratch entry p of the slot (a tree node's parent, a draft step's parent node)
  target[t] -1: not speculative: the state advances in the slot itself
            j' >= 0: speculative: the state after this token goes to scratch entry j' ([L, S, W, ...]), the slot is
            left as it was (StatePool.commit moves the accepted one later)
The conv and the recurrence read and write only through these, and every stride comes from the buffers themselves
(seed 000's second bug took a stride from a caller's argument).

Measured shape of the work: a decode or verify token is a few K MACs per (head, dv block), so a program walks one
request's tokens in order and keeps the recurrent state in registers from token to token (a chain never re-reads
it); only a tree node whose parent is not the previous token reloads it from scratch. Prefill walks the same way,
one token at a time: correct, and linear in the prompt, but not the chunked (WY) form; see docs/kernels.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyperdraft.kernels._triton import jit, libdevice, tl, triton
from hyperdraft.kernels.gated_delta import GdnGates, causal_conv_step, delta_step, prepare_qkv
from hyperdraft.options import triton_interpreted



@dataclass(frozen=True)
class Walk:
    """Where each request's states come from and go (the terms above), as device tensors."""

    num_requests: int
    starts: torch.Tensor  # [B] int32
    lens: torch.Tensor  # [B] int32
    slots: torch.Tensor  # [B] int64
    fresh: torch.Tensor  # [B] int32
    parent: torch.Tensor  # [T] int32
    target: torch.Tensor  # [T] int32


@jit
def _conv_walk(Mixed, Out, Weight, Conv, ConvScratch, Starts, Lens, Slots, Fresh, Parent, Target,
               s_mt, s_ot, s_wc, s_cs, s_cc, s_ck, s_xs, s_xw, s_xc, s_xk, C,
               KM1: tl.constexpr, KP: tl.constexpr, BC: tl.constexpr):
    b = tl.program_id(0)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    col = tl.arange(0, KP)
    cmask = c < C
    wmask = cmask[:, None] & (col[None, :] < KM1)
    w_prev = tl.load(Weight + c[:, None] * s_wc + col[None, :], mask=wmask, other=0.0).to(tl.float32)
    w_last = tl.load(Weight + c * s_wc + KM1, mask=cmask, other=0.0).to(tl.float32)
    start, n = tl.load(Starts + b), tl.load(Lens + b)
    slot = tl.load(Slots + b).to(tl.int64)
    fresh = tl.load(Fresh + b)
    committed = Conv + slot * s_cs + c[:, None] * s_cc
    scratch = ConvScratch + slot * s_xs + c[:, None] * s_xc
    for j in range(0, n):
        t = (start + j).to(tl.int64)
        parent, target = tl.load(Parent + t), tl.load(Target + t)
        src = committed + col[None, :] * s_ck
        if parent >= 0:
            src = scratch + parent * s_xw + col[None, :] * s_xk
        tl.debug_barrier()  # the previous token's window, stored by other threads of this program, is visible
        zero = (j == 0) & (fresh != 0) & (target < 0)
        window = tl.load(src, mask=wmask & (zero == 0), other=0.0).to(tl.float32)  # [BC, KP]: columns 0..K-2
        shifted = tl.load(src + s_ck, mask=cmask[:, None] & (col[None, :] < KM1 - 1) & (zero == 0), other=0.0)
        x = tl.load(Mixed + t * s_mt + c, mask=cmask, other=0.0)
        acc = tl.sum(window * w_prev, axis=1) + x.to(tl.float32) * w_last
        tl.store(Out + t * s_ot + c, (acc / (1.0 + tl.exp(-acc))).to(Out.dtype.element_ty), mask=cmask)
        new = tl.where(col[None, :] == KM1 - 1, x[:, None].to(shifted.dtype), shifted)
        dst = committed + col[None, :] * s_ck
        if target >= 0:
            dst = scratch + target * s_xw + col[None, :] * s_xk
        tl.debug_barrier()  # every thread has read the source window before any overwrites it (a slot in place)
        tl.store(dst, new.to(Conv.dtype.element_ty), mask=wmask)


@jit
def _delta_walk(QKV, A, B, ALog, DtBias, Out, State, Scratch, Starts, Lens, Slots, Fresh, Parent, Target,
                s_qt, s_at, s_bt, s_ot, s_oh, s_ss, s_sh, s_sk, s_xs, s_xw, s_xh, s_xk, key_dim, scale,
                GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                LIBDEVICE: tl.constexpr):
    b, h = tl.program_id(0), tl.program_id(1)
    kk = tl.arange(0, BK)
    vv = tl.program_id(2) * BV + tl.arange(0, BV)
    kmask, vmask = kk < DK, vv < DV
    smask = kmask[:, None] & vmask[None, :]
    start, n = tl.load(Starts + b), tl.load(Lens + b)
    slot = tl.load(Slots + b).to(tl.int64)
    fresh = tl.load(Fresh + b)
    committed = State + slot * s_ss + h * s_sh + kk[:, None] * s_sk + vv[None, :]
    scratch = Scratch + slot * s_xs + h * s_xh + kk[:, None] * s_xk + vv[None, :]
    kh = h // GROUP
    decay_rate = tl.exp(tl.load(ALog + h).to(tl.float32))
    dt_bias = tl.load(DtBias + h).to(tl.float32)
    state = tl.zeros([BK, BV], dtype=tl.float32)
    prev_target = tl.zeros([], dtype=tl.int32) - 3
    for j in range(0, n):
        t = (start + j).to(tl.int64)
        parent, target = tl.load(Parent + t), tl.load(Target + t)
        if (j == 0) | ((parent != -2) & (parent != prev_target)):  # else: carried from the previous token
            if parent >= 0:
                tl.debug_barrier()  # this program stored the parent's state a token or more ago
                state = tl.load(scratch + parent * s_xw, mask=smask, other=0.0).to(tl.float32)
            else:
                zero = (fresh != 0) & (target < 0)
                state = tl.load(committed, mask=smask & (zero == 0), other=0.0).to(tl.float32)
        q = tl.load(QKV + t * s_qt + kh * DK + kk, mask=kmask, other=0.0).to(tl.float32)
        k = tl.load(QKV + t * s_qt + key_dim + kh * DK + kk, mask=kmask, other=0.0).to(tl.float32)
        v = tl.load(QKV + t * s_qt + 2 * key_dim + h * DV + vv, mask=vmask, other=0.0).to(tl.float32)
        q = q * tl.rsqrt(tl.sum(q * q) + 1e-6) * scale
        k = k * tl.rsqrt(tl.sum(k * k) + 1e-6)
        # GdnGates.decay_and_beta, in the loop: softplus as torch's (x past 20 passes through), beta rounded to b's dtype
        a = tl.load(A + t * s_at + h).to(tl.float32) + dt_bias
        if LIBDEVICE:
            softplus = tl.where(a > 20.0, a, libdevice.log1p(tl.exp(a)))
        else:
            softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))
        g = -decay_rate * softplus
        b_in = tl.load(B + t * s_bt + h)
        beta = (1.0 / (1.0 + tl.exp(-b_in.to(tl.float32)))).to(b_in.dtype).to(tl.float32)
        # the rule: h <- h * exp(g);  u = beta * (v - h^T k);  h <- h + k u^T;  o = h^T q
        state = state * tl.exp(g)
        u = beta * (v - tl.sum(state * k[:, None], axis=0))
        state = state + k[:, None] * u[None, :]
        # a state kept in a narrower dtype is rounded after every token, so carrying it equals storing and reloading
        state = state.to(State.dtype.element_ty).to(tl.float32)
        o = tl.sum(state * q[:, None], axis=0)
        tl.store(Out + t * s_ot + h * s_oh + vv, o.to(Out.dtype.element_ty), mask=vmask)
        if target >= 0:
            tl.store(scratch + target * s_xw, state.to(Scratch.dtype.element_ty), mask=smask)
        prev_target = target
    last_target = tl.load(Target + start + n - 1, mask=n > 0, other=0)
    if (n > 0) & (last_target < 0):
        tl.store(committed, state.to(State.dtype.element_ty), mask=smask)


def conv_walk(mixed: torch.Tensor, weight: torch.Tensor, conv: torch.Tensor, conv_scratch: torch.Tensor,
              walk: Walk) -> torch.Tensor:
    """mixed [T, C]; weight [C, K]; conv [S, C, K-1] and conv_scratch [S, W, C, K-1] (one layer) -> SiLU(conv) [T, C]
    in mixed's dtype; the windows go to the slots or scratch entries `walk` names."""
    out = torch.empty_like(mixed)
    channels, k = weight.shape
    bc = 128
    _conv_walk[(walk.num_requests, triton.cdiv(channels, bc))](
        mixed, out, weight, conv, conv_scratch, walk.starts, walk.lens, walk.slots, walk.fresh, walk.parent,
        walk.target, mixed.stride(0), out.stride(0), weight.stride(0), *conv.stride(), *conv_scratch.stride(),
        channels, KM1=k - 1, KP=triton.next_power_of_2(k - 1), BC=bc, num_warps=4)
    return out


def delta_walk(qkv: torch.Tensor, gates: GdnGates, recurrent: torch.Tensor, recurrent_scratch: torch.Tensor,
               walk: Walk, key_dim: int, out_dtype: torch.dtype) -> torch.Tensor:
    """qkv [T, C] (the conv's output), gates over [T, HV] (the decay and beta are computed here); recurrent
    [S, HV, dk, dv] and recurrent_scratch [S, W, HV, dk, dv] (one layer) -> o [T, HV, dv]."""
    _, heads, dk, dv = recurrent.shape
    assert gates.a.stride(-1) == 1 and gates.b.stride(-1) == 1, "gate inputs: heads contiguous"
    out = torch.empty(qkv.shape[0], heads, dv, dtype=out_dtype, device=qkv.device)
    bv = min(triton.next_power_of_2(dv), 32)  # [dk, 32] fp32 per program: registers, and HV * dv / 32 programs
    group = heads // (key_dim // dk)
    _delta_walk[(walk.num_requests, heads, triton.cdiv(dv, bv))](
        qkv, gates.a, gates.b, gates.A_log, gates.dt_bias, out, recurrent, recurrent_scratch, walk.starts, walk.lens,
        walk.slots, walk.fresh, walk.parent, walk.target, qkv.stride(0), gates.a.stride(0), gates.b.stride(0),
        out.stride(0), out.stride(1),
        recurrent.stride(0), recurrent.stride(1), recurrent.stride(2), recurrent_scratch.stride(0),
        recurrent_scratch.stride(1), recurrent_scratch.stride(2), recurrent_scratch.stride(3), key_dim,
        dk ** -0.5, GROUP=group, DK=dk, DV=dv, BK=triton.next_power_of_2(dk), BV=bv, LIBDEVICE=not triton_interpreted(),
        num_warps=4)
    return out


def walk_reference(mixed, weight, g, beta, conv, conv_scratch, recurrent, recurrent_scratch, walk: Walk,
                   key_dim: int, k_head_dim: int):
    """conv_walk then delta_walk, token by token in torch (the test oracle): -> o [T, HV, dv] in mixed's dtype."""
    heads, dv = recurrent.shape[1], recurrent.shape[3]
    out = torch.zeros(mixed.shape[0], heads, dv, dtype=mixed.dtype, device=mixed.device)
    starts, lens, slots, fresh = (x.tolist() for x in (walk.starts, walk.lens, walk.slots, walk.fresh))
    parents, targets = walk.parent.tolist(), walk.target.tolist()
    for b in range(walk.num_requests):
        for j in range(lens[b]):
            t, s = starts[b] + j, slots[b]
            parent, target = parents[t], targets[t]
            zero = j == 0 and fresh[b] and target < 0
            if parent >= 0:
                cs, rs = conv_scratch[s, parent], recurrent_scratch[s, parent]
            else:
                cs, rs = (torch.zeros_like(conv[s]), torch.zeros_like(recurrent[s])) if zero else (conv[s], recurrent[s])
            x, cs = causal_conv_step(mixed[t][None], cs[None], weight)
            q, k, v = prepare_qkv(x, key_dim, k_head_dim, heads, dv)
            o, rs = delta_step(rs.float()[None], q, k, v, g[t][None], beta[t][None])
            out[t] = o[0].to(out.dtype)
            if target >= 0:
                conv_scratch[s, target], recurrent_scratch[s, target] = cs[0], rs[0].to(recurrent_scratch.dtype)
            else:
                conv[s], recurrent[s] = cs[0], rs[0].to(recurrent.dtype)
    return out


@jit
def _commit(Dst, Src, Slots, Index, s_dl, s_ds, s_sl, s_ss, s_sw, numel, BLOCK: tl.constexpr):
    b, layer = tl.program_id(0), tl.program_id(1).to(tl.int64)
    index = tl.load(Index + b)
    if index >= 0:
        slot = tl.load(Slots + b).to(tl.int64)
        offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        x = tl.load(Src + layer * s_sl + slot * s_ss + index * s_sw + offs, mask=mask)
        tl.store(Dst + layer * s_dl + slot * s_ds + offs, x, mask=mask)


def commit_states(committed: torch.Tensor, scratch: torch.Tensor, slots: torch.Tensor, index: torch.Tensor) -> None:
    """committed [L, S, *state], scratch [L, S, W, *state] (each state contiguous): scratch[:, slots[b], index[b]] ->
    committed[:, slots[b]] for every b with index[b] >= 0, over every layer in one launch."""
    numel = committed[0, 0].numel()
    block = 4096
    _commit[(slots.shape[0], committed.shape[0], triton.cdiv(numel, block))](
        committed, scratch, slots, index, committed.stride(0), committed.stride(1), scratch.stride(0),
        scratch.stride(1), scratch.stride(2), numel, BLOCK=block, num_warps=4)
