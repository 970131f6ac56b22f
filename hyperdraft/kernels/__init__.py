"""Triton kernels for CUDA, each beside a plain-torch reference of the same signature.

Nothing here imports triton at module load: CPU machines (CI included) have no triton, and `import hyperdraft`
must work there. Each kernel module takes it from _triton.py, which leaves it None there; the references need
only torch.

- attention.py: paged attention (decode, extend over a cached prefix, tree-masked verify), split-K + merge;
  attention_tiles.py: its tiles and split counts (static sizes only), deterministic mode's fixed ones
- kv_store.py: new K/V into the paged pool (one launch for K and V)
- kv_move.py: the accepted-path compaction copy, every layer, gather-then-scatter
- norm.py, activation.py, rope.py: RMSNorm (+ residual add), SiLU(gate) * up and the gated attention's
  x * sigmoid(gate), rotary embedding in place (partial too) and the cos/sin table of a forward's positions
- vocab_map.py: an EAGLE-3 head's draft-vocabulary logits spread over the target vocabulary
- uniform.py, argmax.py: counter-based uniforms (bit-identical to sample/rng.py), row argmax over a vocabulary
- logprob.py: chosen tokens' log-probabilities (one log-sum-exp per row)
- gemv.py: projections of at most 16 rows, streaming the weights; pdl.py: programmatic dependent launch
- gemv_mma.cu (CUDA C, built with nvcc and launched by cuda_kernels.py): gemv.py's 2..16-row tensor-core kernel
  where it fits, its weight operands loaded straight into MMA registers (Triton's layouts cannot say that)
- draft_plan.py: a draft round's bookkeeping (catch-up batch and step plan, draft-ahead packing, chain accept)
"""

from __future__ import annotations

import functools

from hyperdraft import options


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_fused_kernels(x) -> bool:
    """Whether the model should run the Triton kernels on this tensor (else the torch references): on CUDA, unless
    the active RuntimeOptions turn them off (A/B measurements)."""
    return x.is_cuda and options.current().fused_kernels and triton_available()
