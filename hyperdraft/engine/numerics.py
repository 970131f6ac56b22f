"""What an engine's numerics promise, by device, dtype and mode (docs/numerics.md states it for users).

- float32: greedy speculative output is token for token plain decoding's (tested on CPU and GPU);
- bf16/fp16, default: the same logic, but a row's logits depend on what shares its launches (batch size, verify
  width, graphs or eager, split-K choices), so a near-tie may flip: not bitwise;
- bf16/fp16, deterministic (CUDA, dense models, Qwen3.5 hybrids included): batch-invariant kernels make a row's
  results the same bits however it was batched, so greedy speculative output is bitwise plain decoding's.
"""

from __future__ import annotations

import logging

import torch

from hyperdraft.models.config import ModelConfig
from hyperdraft.options import RuntimeOptions

logger = logging.getLogger("hyperdraft")


def check_deterministic(cfg: ModelConfig, device: torch.device, backend: str, options: RuntimeOptions) -> None:
    """enable_deterministic_inference's reach: batch-invariant kernels exist for dense models on CUDA (a Gated
    DeltaNet layer's walk already gives each token the same per-step arithmetic in a prefill, a decode and a verify).
    Elsewhere it is refused, or on the CPU a no-op (with a warning)."""
    if not options.deterministic:
        return
    if cfg.moe is not None:
        raise ValueError("enable_deterministic_inference supports dense models (llama, qwen2, qwen3, qwen3_5) so far; "
                         f"{cfg.architecture} has MoE layers (the experts' weighted sum is not batch-invariant yet)")
    if device.type != "cuda":
        logger.warning("enable_deterministic_inference changes nothing on the CPU: its products are not batch-"
                       "invariant in bf16, and in float32 greedy speculative output already equals plain decoding")
        return
    if backend != "triton" or not options.fused_kernels:
        fused = "on" if options.fused_kernels else "off"
        raise ValueError("enable_deterministic_inference needs attention_backend='triton' and the fused kernels (got "
                         f"attention_backend={backend!r}, fused kernels {fused})")


def numerics_mode(device: torch.device, dtype: torch.dtype, options: RuntimeOptions) -> str:
    """'float32', '<dtype> default' or '<dtype> deterministic' (the mode /server_info reports)."""
    name = str(dtype).removeprefix("torch.")
    if dtype == torch.float32:
        return name
    return f"{name} {'deterministic' if options.deterministic and device.type == 'cuda' else 'default'}"
