"""PushAllReduce: the small all-reduces of a split model (decode rows, verify rows) as one kernel launch each,
through buffers every rank of one node can write (torch's symmetric memory); kernels/all_reduce.py has the protocol
and the measured reason. Larger tensors (prefill chunks) and other dtypes go through NCCL. The default on one node
of GPUs that reach each other's memory (engine/lockstep.py push_wanted); --disable-custom-all-reduce turns it off.

Torch's symmetric memory remembers a group by its name for the life of the process, but group names restart from
"0" whenever the default group is destroyed and made again: a second tensor-parallel engine in one process (rank 0's
process outlives each engine's followers) would rendezvous through the first engine's dead store and hang. So each
PushAllReduce makes its own group, named after how many rank 0's process has made (rank 0 broadcasts the count).

On the CPU, under Triton's interpreter (which runs the same kernel on CPU tensors), the buffers are shared-memory
files each rank maps: tests run the whole engine with it there (tests/gpu/test_push_all_reduce.py).

One receive buffer per element width (2 bytes: bf16 and fp16; 4 bytes: fp32), because an empty slot holds that
width's -0.0: a buffer shared by both widths would read one width's sentinel as the other's data. Every rank builds
its buffers in the same order at group start-up (a collective), before any model exists, so a draft model split over
the same ranks shares them.
"""

from __future__ import annotations

import itertools
import os

import torch
import torch.distributed as dist

from hyperdraft.kernels.all_reduce import BLOCK, INT_OF, SENTINEL, SLOTS, WAIT_LIMIT_S, push_all_reduce

SLOT_BYTES = 1 << 20  # per rank and slot: 64 rows of an 8192-wide bf16 model (a batch-8 chain-5 verify is 48 rows)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_GROUPS_MADE = itertools.count()  # in this process (rank 0's counts for every rank)


class _Lane:
    """The receive buffers (each rank's, as this process reaches it), and the call counters, for one element width."""

    def __init__(self, size: int, peers: list[torch.Tensor], device: torch.device):
        self.capacity = peers[0].numel() // (SLOTS * size)  # elements per slot
        self.peers = peers  # keeps every mapping open
        self.buffers = torch.tensor([p.data_ptr() for p in peers], dtype=torch.int64, device=device)
        self.counters = torch.zeros(-(-self.capacity // BLOCK), dtype=torch.int64, device=device)


def _symmetric_buffers(width: int, rank: int, size: int, device: torch.device, group_name: str) -> list[torch.Tensor]:
    import torch.distributed._symmetric_memory as symm_mem

    dtype = INT_OF[width]
    recv = symm_mem.empty(SLOTS * size * (SLOT_BYTES // width), dtype=dtype, device=device)
    handle = symm_mem.rendezvous(recv, group_name)
    recv.fill_(SENTINEL[width])
    return [recv if peer == rank else handle.get_buffer(peer, (recv.numel(),), dtype) for peer in range(size)]


def _shared_file_buffers(width: int, rank: int, size: int, tag: str, control) -> list[torch.Tensor]:
    """CPU processes (the kernel under Triton's interpreter, for tests): one shared-memory file per rank, which every
    rank maps; unlinked once all have (the mappings stay)."""
    numel = SLOTS * size * (SLOT_BYTES // width)
    path = f"/dev/shm/hyperdraft-push-{tag}-{width}-{{}}"
    mine = torch.from_file(path.format(rank), shared=True, size=numel, dtype=INT_OF[width])
    mine.fill_(SENTINEL[width])
    dist.barrier(group=control)
    peers = [mine if peer == rank else torch.from_file(path.format(peer), shared=True, size=numel, dtype=mine.dtype)
             for peer in range(size)]
    dist.barrier(group=control)
    os.unlink(path.format(rank))
    return peers


def _rank0_token(control) -> tuple[int, int]:
    """(how many PushAllReduce rank 0's process has made, its pid), on every rank (collective)."""
    token = [(next(_GROUPS_MADE), os.getpid())]
    dist.broadcast_object_list(token, src=0, group=control)
    return token[0]


def _fresh_group(made: int) -> object:
    """A new group over every rank whose name no earlier group of rank 0's process had (collective)."""
    world = dist.distributed_c10d._world
    world.group_count = max(world.group_count, 1000 + made)  # names "1000", "1001", ...: above the engine's own
    return dist.new_group(ranks=list(range(dist.get_world_size())))


class PushAllReduce:
    def __init__(self, rank: int, size: int, device: torch.device, control=None, wait_limit_s: float = WAIT_LIMIT_S):
        """control: a group for the host-side agreements (None: the default group); wait_limit_s: how long a call
        waits for a peer's part before its kernel traps (the engine's dist_timeout). On the CPU the buffers are
        shared-memory files and the kernel runs under Triton's interpreter (tests of the engine with it)."""
        self.rank, self.size, self.wait_limit_s, self.device = rank, size, wait_limit_s, device
        made, pid = _rank0_token(control)
        if device.type == "cuda":
            group_name = _fresh_group(made).group_name
            try:
                peers = {width: _symmetric_buffers(width, rank, size, device, group_name) for width in (2, 4)}
                torch.cuda.synchronize(device)
            except RuntimeError as e:  # e.g. a container that forbids mapping another process's GPU memory
                raise RuntimeError(f"tensor-parallel rank {rank}: the push all-reduce could not map its peers' GPU "
                                   f"memory ({e}); run with --disable-custom-all-reduce to send every all-reduce "
                                   "through NCCL") from e
        else:
            peers = {width: _shared_file_buffers(width, rank, size, f"{pid}-{made}", control) for width in (2, 4)}
        self.lanes = {width: _Lane(size, buffers, device) for width, buffers in peers.items()}
        dist.barrier(group=control)  # every rank's sentinels are written before any rank pushes

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype in DTYPES and x.device.type == self.device.type and \
            x.numel() <= self.lanes[x.element_size()].capacity

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the group, a new tensor of x's shape (fits(x) must hold, on every rank alike)."""
        lane = self.lanes[x.element_size()]
        return push_all_reduce(x, lane.buffers, lane.capacity, lane.counters, self.rank, self.size, self.wait_limit_s)
