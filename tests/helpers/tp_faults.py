"""Fault injection for tensor-parallel tests: stand-ins for engine.follow, the function each follower process runs.
Spawned processes import them by name, so they live in a module, not a test."""

from __future__ import annotations

import os

import torch

from hyperdraft.engine.lockstep import init_group


def follow_then_exit(rank, args, options, address, threads) -> None:
    """A follower that joins the group and then dies before building its engine (as an out-of-memory rank would)."""
    init_group(args, rank, address, torch.device("cpu"), options)
    os._exit(3)


# A variable the parent sets only after its first tensor-parallel engine started the follower process server.
FOLLOWER_MARK = ("TP_TEST_FOLLOWER_MARK", "set after the server started")


def follow_if_marked(rank, args, options, address, threads) -> None:
    """The real follower, if its process sees FOLLOWER_MARK in its environment; else it joins the group (so that rank
    0 learns of it at once, not at the rendezvous timeout) and exits with code 4."""
    from hyperdraft.engine.engine import follow

    name, value = FOLLOWER_MARK
    if os.environ.get(name) != value:
        init_group(args, rank, address, torch.device("cpu"), options)
        os._exit(4)
    follow(rank, args, options, address, threads)
