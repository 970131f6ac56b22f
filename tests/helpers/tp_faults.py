"""Fault injection for tensor-parallel tests: stand-ins for engine.follow, the function each follower process runs.
Spawned processes import them by name, so they live in a module, not a test."""

from __future__ import annotations

import os

import torch

from hyperdraft.engine.lockstep import init_group


def follow_then_exit(rank, args, options, address) -> None:
    """A follower that joins the group and then dies before building its engine (as an out-of-memory rank would)."""
    init_group(args, rank, address, torch.device("cpu"), options)
    os._exit(3)
