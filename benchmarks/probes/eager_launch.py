"""What an eager forward of a small model costs on the host: one Triton launch, one torch launch, and a whole eager
SmolLM2-shaped forward (random bf16 weights) at 1, 96 and 300 tokens, against its CUDA-event GPU time.

  python -m benchmarks.probes.eager_launch
"""

from __future__ import annotations

import statistics
import tempfile
import time

import torch

from benchmarks.common import require_cuda
from benchmarks.e2e.engines import make_engine, write_configs
from benchmarks.probes.small_spec_batch import SMOLLM2
from hyperdraft.core.forward_batch import ForwardInput, ForwardMode, build_forward_batch
from hyperdraft.kernels.norm import rms_norm


def per_call_us(fn, n: int = 2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - start) / n
    torch.cuda.synchronize()
    return 1e6 * host


def main() -> None:
    require_cuda()
    x = torch.randn(4, 576, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(576, device="cuda", dtype=torch.bfloat16)
    print(f"host us per call: triton rms_norm {per_call_us(lambda: rms_norm(x, w, 1e-5)):.1f}, "
          f"torch add {per_call_us(lambda: x + x):.1f}, torch.mm {per_call_us(lambda: x @ x.T):.1f}")
    from hyperdraft.kernels.norm import _rms_norm
    out = torch.empty_like(x)
    args = (x, x, w, out, x, x.stride(0), 576, 0, 1, 576, 1e-5)

    def raw(pdl):
        return lambda: _rms_norm[(4, 1)](*args, HAS_RESIDUAL=False, BLOCK_D=1024, num_warps=4, ZERO_CENTERED=False,
                                         **({"PDL": True, "launch_pdl": True} if pdl else {"PDL": False}))
    print(f"raw _rms_norm[grid](...): {per_call_us(raw(False)):.1f} us, with PDL {per_call_us(raw(True)):.1f} us")
    kernel = raw(False)()
    from triton import knobs
    stream = torch.cuda.current_stream().cuda_stream
    names = list(_rms_norm.arg_names)
    values = dict(zip(names, args))
    values.update(HAS_RESIDUAL=False, BLOCK_D=1024, ZERO_CENTERED=False, PDL=False)
    bound = [values[n] for n in names]

    def direct():
        kernel.run(4, 1, 1, stream, kernel.function, kernel.packed_metadata, None, knobs.runtime.launch_enter_hook,
                   knobs.runtime.launch_exit_hook, *bound)
    print(f"CompiledKernel.run directly: {per_call_us(direct):.1f} us")
    binder = _rms_norm.device_caches[torch.cuda.current_device()][4]
    print(f"Triton's binder alone: {per_call_us(lambda: binder(*args, HAS_RESIDUAL=False, BLOCK_D=1024, num_warps=4, ZERO_CENTERED=False, PDL=False)):.1f} us")
    target, _ = write_configs(tempfile.mkdtemp(), SMOLLM2, 32000)
    engine, _ = make_engine(target, "cuda", 8, None, 8 * 2048)
    runner, table = engine.runner, engine.runner.page_table
    row = table.acquire_row()
    table.reserve(row, 1024)
    for tokens in (1, 96, 300):
        inputs = [ForwardInput(row, 0, list(range(10, 10 + tokens)), 1)]
        fb = build_forward_batch(ForwardMode.EXTEND, inputs, table, runner.device)
        hosts, gpus = [], []
        for _ in range(20):
            torch.cuda.synchronize()
            start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start = time.perf_counter()
            start_ev.record()
            runner.forward_eager(fb)
            end_ev.record()
            hosts.append(time.perf_counter() - start)
            torch.cuda.synchronize()
            gpus.append(start_ev.elapsed_time(end_ev) / 1e3)
        print(f"eager forward, {tokens} tokens: host {1e3 * statistics.median(hosts):.2f} ms to enqueue, "
              f"GPU span {1e3 * statistics.median(gpus):.2f} ms")
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner.forward_eager(fb)
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_time_total > 0]
    print(f"launches in one eager forward: {sum(e.count for e in kernels)}; GPU kernel time "
          f"{sum(e.self_device_time_total for e in kernels) / 1e3:.2f} ms")


if __name__ == "__main__":
    main()
