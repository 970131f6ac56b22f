"""Programmatic dependent launch (PDL, Hopper and later): a kernel launched with it may be scheduled while the
kernel before it in the stream is still finishing, and waits inside (`griddepcontrol.wait`) only where it first
needs that kernel's results. At batch 1 an 8B decoder runs ~10 short dependent kernels per layer; without PDL each
boundary drains the GPU (the last blocks' tail, then the next kernel's launch and first loads). With it, a GEMV
streams its first weight tiles into L2 before it waits (weights never depend on the previous kernel), and the
small kernels' launch latency hides behind their predecessor (benchmarks/results/pdl_chain_h100.md).

The rule every PDL kernel here keeps: each program calls `pdl_wait(PDL)` before it reads anything an earlier
kernel wrote, before it writes anything, and before any early return. A kernel's completion then implies its
predecessor's, so ordering stays transitive along the stream. Only weight reads may come first.
"""

from __future__ import annotations

import functools

import torch

from hyperdraft import options
from hyperdraft.options import triton_interpreted

from hyperdraft.kernels._triton import jit, tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # no triton (CPU), or one without grid dependency control
    gdc_launch_dependents = gdc_wait = None



@functools.cache
def _device_has_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    """RuntimeOptions.pdl off (HYPERDRAFT_DISABLE_PDL=1) launches every kernel plainly (A/B measurements, older
    drivers); Triton's CPU interpreter has no grid dependency control."""
    return (device.type == "cuda" and gdc_wait is not None and options.current().pdl and not triton_interpreted()
            and _device_has_pdl(device.index if device.index is not None else torch.cuda.current_device()))


def pdl_args(device: torch.device) -> dict:
    """Launch keywords for a kernel taking a `PDL: tl.constexpr` parameter that it hands to pdl_wait."""
    return {"PDL": True, "launch_pdl": True} if pdl_enabled(device) else {"PDL": False}


@jit
def pdl_wait(PDL: tl.constexpr):
    """Wait until the previous kernel in the stream has completed and its writes are visible, then let the next
    one be scheduled (it will wait in turn): at most two kernels are in flight, so waiting blocks never crowd out
    working ones."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
