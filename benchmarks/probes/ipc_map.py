"""Can the push all-reduce map its peers' buffers without torch's symmetric memory, so that every engine of a process
gets it (distributed/push_all_reduce.py: today only the first, because symmetric memory numbers its store
exchanges once per process and a later engine's fresh followers start at zero)?

The candidate: each rank cudaMallocs its receive buffer, exports a CUDA IPC handle, the ranks swap handles over a
gloo group, and each opens its peers' on its OWN device (so no CUDA context is made on the peer's GPU, as torch's
tensor sharing would, opening under the peer's device). This probe plays three engines in a row in one rank-0
process, each with a freshly spawned rank 1 (as the engine starts its followers): per round, each rank fills its
buffer with the empty mark and runs the push all-reduce kernel itself through the mapped addresses.

  python -m benchmarks.probes.ipc_map          # two GPUs -> one line per round, "ok" or what differed
"""

from __future__ import annotations

import ctypes
import ctypes.util
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hyperdraft.kernels.all_reduce import BLOCK, SENTINEL, SLOTS, all_reduce_reference, push_all_reduce

ROUNDS, NUMEL = 3, SLOTS * 2 * (1 << 18)  # int16 elements: three slots of two ranks' 256k elements


class IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_byte * 64)]  # cudaIpcMemHandle_t


def cudart() -> ctypes.CDLL:
    """The CUDA runtime torch loaded (its path from this process's memory map), else the system's."""
    torch.cuda.init()
    with open("/proc/self/maps") as maps:
        paths = [line.split()[-1] for line in maps if "libcudart" in line]
    lib = ctypes.CDLL(paths[0] if paths else ctypes.util.find_library("cudart"))
    lib.cudaSetDevice.argtypes = [ctypes.c_int]
    lib.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
    lib.cudaFree.argtypes = [ctypes.c_void_p]
    lib.cudaIpcGetMemHandle.argtypes = [ctypes.POINTER(IpcHandle), ctypes.c_void_p]
    lib.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), IpcHandle, ctypes.c_uint]
    lib.cudaIpcCloseMemHandle.argtypes = [ctypes.c_void_p]
    return lib


def check(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"{what} failed with CUDA error {code}")


class RawBuffer:
    """A torch view of raw device memory (__cuda_array_interface__), int16 elements."""

    def __init__(self, ptr: int, numel: int):
        self.__cuda_array_interface__ = {"shape": (numel,), "typestr": "<i2", "data": (ptr, False), "version": 3}


def map_buffers(rank: int, lib: ctypes.CDLL) -> tuple[ctypes.c_void_p, ctypes.c_void_p]:
    """(this rank's receive buffer, the peer's as mapped on this rank's device), both raw addresses (collective)."""
    check(lib.cudaSetDevice(rank), "cudaSetDevice")  # in case torch's runtime is another copy of libcudart
    mine = ctypes.c_void_p()
    check(lib.cudaMalloc(ctypes.byref(mine), NUMEL * 2), "cudaMalloc")
    handle = IpcHandle()
    check(lib.cudaIpcGetMemHandle(ctypes.byref(handle), mine), "cudaIpcGetMemHandle")
    handles = [None, None]
    dist.all_gather_object(handles, bytes(handle.reserved))
    peer_handle = IpcHandle()
    ctypes.memmove(peer_handle.reserved, handles[1 - rank], 64)
    peer = ctypes.c_void_p()
    check(lib.cudaIpcOpenMemHandle(ctypes.byref(peer), peer_handle, 1), "cudaIpcOpenMemHandle")  # lazy peer access
    return mine, peer


def one_engine(rank: int, port: int, lib: ctypes.CDLL) -> str:
    """One engine's life on this rank: map the buffers, run the push all-reduce through them (calls of changing
    shapes, checked against the reference sum), unmap. -> "ok" or what differed."""
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    mine, peer = map_buffers(rank, lib)
    torch.as_tensor(RawBuffer(mine.value, NUMEL), device=device).fill_(SENTINEL[2])  # own memory: a plain view
    torch.cuda.synchronize(device)
    dist.barrier()
    addresses = [mine.value, peer.value] if rank == 0 else [peer.value, mine.value]
    buffers = torch.tensor(addresses, dtype=torch.int64, device=device)
    capacity = NUMEL // (SLOTS * 2)
    counters = torch.zeros(-(-capacity // BLOCK), dtype=torch.int64, device=device)
    g = torch.Generator().manual_seed(3)
    wrong = 0
    for shape in [(1, 4096), (8, 4096), (48, 4096), (3, 1000)] * 3:
        parts = [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(2)]
        got = push_all_reduce(parts[rank].to(device), buffers, capacity, counters, rank, 2, wait_limit_s=20.0)
        wrong += not torch.equal(got.cpu(), all_reduce_reference(parts))
    torch.cuda.synchronize(device)
    dist.barrier()
    check(lib.cudaIpcCloseMemHandle(peer), "cudaIpcCloseMemHandle")
    dist.barrier()  # the peer has unmapped before the memory goes
    check(lib.cudaFree(mine), "cudaFree")
    dist.destroy_process_group()
    return "ok" if not wrong else f"{wrong} of 12 calls differ from the reference sum"


def follower(port: int) -> None:
    one_engine(1, port, cudart())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    if torch.cuda.device_count() < 2:
        raise SystemExit("ipc_map needs two GPUs")
    lib = cudart()
    for engine in range(ROUNDS):
        port = free_port()
        proc = mp.get_context("spawn").Process(target=follower, args=(port,))
        proc.start()
        outcome = one_engine(0, port, lib)
        proc.join(timeout=120)
        print(f"engine {engine} of this process, fresh rank 1: {outcome} (rank 1 exit code {proc.exitcode})", flush=True)


if __name__ == "__main__":
    main()
