"""A node other than 0 of a multi-node tensor-parallel group: it only hosts its ranks (engine.follow each), which
reach rank 0 at node 0's address (engine/lockstep.py)."""

from __future__ import annotations

from hyperdraft.config import EngineArgs
from hyperdraft.engine.device import resolve_device
from hyperdraft.engine.engine import follow
from hyperdraft.engine.lockstep import check_devices, node_ranks, start_followers
from hyperdraft.options import RuntimeOptions


def host_ranks(args: EngineArgs, options: RuntimeOptions | None = None) -> None:
    """A node other than 0 (node_rank > 0): run this node's ranks until rank 0 stops the group; raises if one fails."""
    device = resolve_device(args.device)
    check_devices(args, device)
    options = options if options is not None else RuntimeOptions.from_args(args)
    ranks = node_ranks(args)
    followers = start_followers(args, follow, options, ranks, args.dist_init_addr, device)
    for p in followers:
        p.join()
    failed = [(rank, p.exitcode) for rank, p in zip(ranks, followers) if p.exitcode != 0]
    if failed:
        raise RuntimeError(f"tensor-parallel rank {failed[0][0]} exited with code {failed[0][1]}")
