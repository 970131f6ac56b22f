"""The engine's device: which one a name means, and whether its CUDA context survived."""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("hyperdraft")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"device must be cpu, cuda, cuda:N or auto, got {name!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device is cuda but no CUDA device is available")
    return device


def device_lost(device: torch.device) -> bool:
    """Whether this process's CUDA context is gone (after waiting for the device): a kernel trapped, as the push
    all-reduce does when a rank stops arriving, so nothing can run on the device or be freed any more."""
    if device.type != "cuda":
        return False
    try:
        torch.cuda.synchronize(device)
        return False
    except torch.AcceleratorError as error:
        logger.warning("the GPU context is lost (%s); nothing on it can be freed", error)
        return True
