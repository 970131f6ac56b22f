"""Small host values to device tensors without stalling the host.

On CUDA, `torch.tensor(values, device="cuda")` copies from pageable memory, and that copy waits for the
stream: every such call is a host-device sync, and a step full of them serialises the host with the GPU. Staging
the values in pinned memory (the caching host allocator reuses the blocks) makes the copy asynchronous. On CPU it
is plain torch.tensor.
"""

from __future__ import annotations

import itertools

import torch


def to_device(values, dtype: torch.dtype, device) -> torch.Tensor:
    if torch.device(device).type != "cuda":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def host_to_device(host: torch.Tensor, device) -> torch.Tensor:
    """A CPU tensor (e.g. torch.from_numpy) -> device, through pinned memory on CUDA (never a pageable, blocking copy)."""
    if torch.device(device).type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def to_device_many(parts: list[list], dtype: torch.dtype, device) -> list[torch.Tensor]:
    """Several lists -> device tensors of one dtype through ONE copy (then split on the device)."""
    flat = to_device(list(itertools.chain.from_iterable(parts)), dtype, device)
    return list(flat.split([len(p) for p in parts]))
