"""PushAllReduce: the small all-reduces of a split model (decode rows, verify rows) as one kernel launch each,
through buffers every rank of one node can write (torch's symmetric memory); kernels/all_reduce.py has the protocol
and the measured reason. Larger tensors (prefill chunks) and other dtypes go through NCCL. The default on one node
of GPUs that reach each other's memory (engine/lockstep.py push_wanted); --disable-custom-all-reduce turns it off.

One engine per process on CUDA. Torch's symmetric memory numbers its store exchanges with one counter per process, so
once rank 0's process has mapped buffers for an engine, the fresh follower processes of a later engine wait on keys
rank 0 never writes (seen on two H200s: the second TP 2 engine of a test process hung in `rendezvous`, rank 0 at
exchange 4, its new peer at 0). `PushAllReduce.start` therefore gives None, on every rank alike, to any engine after
the first in rank 0's process: that engine sends its all-reduces through NCCL and says so in the log. A server runs
one engine per process; tests and benchmarks that need the kernel in several engines start each in a fresh process.

On the CPU, under Triton's interpreter (which runs the same kernel on CPU tensors), the buffers are shared-memory
files each rank maps: tests run the whole engine with it there (tests/gpu/test_push_all_reduce.py).

One receive buffer per element width (2 bytes: bf16 and fp16; 4 bytes: fp32), because an empty slot holds that
width's -0.0: a buffer shared by both widths would read one width's sentinel as the other's data. Every rank builds
its buffers in the same order at group start-up (a collective), before any model exists, so a draft model split over
the same ranks shares them.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hyperdraft.kernels.all_reduce import BLOCK, INT_OF, SENTINEL, SLOTS, WAIT_LIMIT_S, push_all_reduce

SLOT_BYTES = 1 << 20  # per rank and slot: 64 rows of an 8192-wide bf16 model (a batch-8 chain-5 verify is 48 rows)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
log = logging.getLogger(__name__)


@dataclass
class _History:
    """What this process has started; rank 0's copy decides for every rank (broadcast at each start)."""
    starts: int = 0
    cuda_mapped: bool = False  # torch's symmetric memory has made its exchanges here


_THIS_PROCESS = _History()


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


def _rank0_history(control) -> tuple[_History, int]:
    """(rank 0's process history before this start, its pid), on every rank (collective)."""
    token = [(_History(_THIS_PROCESS.starts, _THIS_PROCESS.cuda_mapped), os.getpid())]
    dist.broadcast_object_list(token, src=0, group=control)
    _THIS_PROCESS.starts += 1
    return token[0]


def _fresh_group(starts: int) -> object:
    """A new group over every rank named "1000" + rank 0's start count (collective), a name no earlier engine's group
    in rank 0's process had. Kept from before the one-engine rule, when a reused name was suspected of pointing the
    rendezvous at a dead engine's store (the hang's real cause was the exchange counter, above); it costs nothing and
    keeps the names of an engine's groups apart from any earlier engine's."""
    world = dist.distributed_c10d._world
    world.group_count = max(world.group_count, 1000 + starts)
    return dist.new_group(ranks=list(range(dist.get_world_size())))


class PushAllReduce:
    @classmethod
    def start(cls, rank: int, size: int, device: torch.device, control=None,
              wait_limit_s: float = WAIT_LIMIT_S) -> "PushAllReduce | None":
        """The push all-reduce of a new group (collective), or None on every rank where it cannot map its buffers:
        on CUDA, when rank 0's process already has (see the module's docstring). control: a group for the host-side
        agreements (None: the default group); wait_limit_s: how long a call waits for a peer's part before its kernel
        traps (the engine's dist_timeout)."""
        history, pid = _rank0_history(control)
        if device.type == "cuda" and history.cuda_mapped:
            if rank == 0:
                log.warning("tensor parallelism: all-reduces go through NCCL, not the push kernel: torch's symmetric "
                            "memory serves one engine per process and an earlier engine here used it")
            return None
        return cls(rank, size, device, control, wait_limit_s, history.starts, pid)

    def __init__(self, rank: int, size: int, device: torch.device, control, wait_limit_s: float, starts: int,
                 rank0_pid: int):
        """Use start(). On the CPU the buffers are shared-memory files named after rank 0's pid and start count, and
        the kernel runs under Triton's interpreter (tests of the engine with it)."""
        self.rank, self.size, self.wait_limit_s, self.device = rank, size, wait_limit_s, device
        if device.type == "cuda":
            _THIS_PROCESS.cuda_mapped = True
            group_name = _fresh_group(starts).group_name
            try:
                peers = {width: _symmetric_buffers(width, rank, size, device, group_name) for width in (2, 4)}
                torch.cuda.synchronize(device)
            except RuntimeError as e:  # e.g. a container that forbids mapping another process's GPU memory
                raise RuntimeError(f"tensor-parallel rank {rank}: the push all-reduce could not map its peers' GPU "
                                   f"memory ({e}); run with --disable-custom-all-reduce to send every all-reduce "
                                   "through NCCL") from e
        else:
            tag = f"{rank0_pid}-{starts}"
            peers = {width: _shared_file_buffers(width, rank, size, tag, control) for width in (2, 4)}
        self.lanes = {width: _Lane(size, buffers, device) for width, buffers in peers.items()}
        dist.barrier(group=control)  # every rank's sentinels are written before any rank pushes

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype in DTYPES and x.device.type == self.device.type and \
            x.numel() <= self.lanes[x.element_size()].capacity

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the group, a new tensor of x's shape (fits(x) must hold, on every rank alike)."""
        lane = self.lanes[x.element_size()]
        return push_all_reduce(x, lane.buffers, lane.capacity, lane.counters, self.rank, self.size, self.wait_limit_s)
