"""All-reduce latency for tensor parallelism on two GPUs, inside a CUDA graph as the engine runs it: 64 back-to-back
all-reduces of one decode row ([rows, 4096] bf16, a Llama-8B layer pair's worth), NCCL (torch.distributed) against
torch's symmetric-memory one-shot all-reduce (peer loads over NVLink, no multicast) and against our push all-reduce
(kernels/all_reduce.py: parts written into the peers' buffers, one launch), checked for the right sums.

  python -m benchmarks.probes.allreduce_latency           # two GPUs -> stdout
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPEATS, HIDDEN = 64, 4096


def graph_time(fn, device) -> float:
    """Microseconds per call of fn, REPEATS calls captured in one graph, median of 20 replays."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(REPEATS):
            fn()
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize(device)
        times.append(start.elapsed_time(end) * 1000 / REPEATS)
    return sorted(times)[len(times) // 2]


def rank_main(rank: int, port: int) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, device_id=device)
    import torch.distributed._symmetric_memory as symm_mem

    from hyperdraft.distributed.push_all_reduce import PushAllReduce

    push = PushAllReduce.start(rank, 2, device, dist.new_group(backend="gloo"))
    group = dist.group.WORLD.group_name
    for rows in (1, 8, 48):
        x = torch.full((rows, HIDDEN), rank + 1.0, dtype=torch.bfloat16, device=device)
        y = x.clone()
        nccl_us = graph_time(lambda: dist.all_reduce(y), device)
        buf = symm_mem.empty((rows, HIDDEN), dtype=torch.bfloat16, device=device)
        symm_mem.rendezvous(buf, group)
        out = torch.empty_like(x)

        def one_shot():
            buf.copy_(x)
            torch.ops.symm_mem.one_shot_all_reduce_out(buf, "sum", group, out)

        one_shot()
        torch.cuda.synchronize(device)
        ok = bool((out == 3.0).all())
        symm_us = graph_time(one_shot, device)
        ok = ok and bool((out == 3.0).all())
        pushed = []
        push_us = graph_time(lambda: pushed.append(push(x)), device)
        ok = ok and bool((pushed[-1] == 3.0).all())
        if rank == 0:
            print(f"rows {rows}: NCCL {nccl_us:.1f} us, symmetric-memory one-shot (with the copy in) {symm_us:.1f} us, "
                  f"push {push_us:.1f} us, sums right: {ok}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(port,), nprocs=2, join=True)


if __name__ == "__main__":
    main()
