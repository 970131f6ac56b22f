"""to_device: small host values to a device tensor without stalling the host.

On CUDA, `torch.tensor(values, device="cuda")` copies from pageable memory, and that copy waits for the
stream: every such call is a host-device sync, and a step full of them serialises the host with the GPU. Staging
the values in pinned memory (the caching host allocator reuses the blocks) makes the copy asynchronous. On CPU it
is plain torch.tensor.
"""

from __future__ import annotations

import torch


def to_device(values, dtype: torch.dtype, device) -> torch.Tensor:
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
