"""Prototype benchmark: gemv_mma.cu (tensor-core six-row GEMV fed from registers, no shared-memory pipeline) against
the engine's Triton kernels (kernels/gemv.py: `_gemv_vec` at one row, `_gemv_dot` at six rows).

The kernels are built here with nvcc (sm_90a cubin) and launched through the CUDA driver API (ctypes, no torch
extension build) with programmatic dependent launch, as the Triton kernels are. Each cell: us per product, a CUDA
graph chaining products of one shape over distinct weights (nothing stays in L2), as benchmarks/gemv_shapes.py.
Every variant is checked against an fp32 F.linear first (relative error) and for batch invariance (rows 0..5 of a
six-row product equal the same rows of a two-row product).

Run on a GPU machine: PYTHONPATH=. python3 benchmarks/cuda_gemv/bench.py ; prints a table, writes $OUT/cuda_gemv.md.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import hyperdraft.kernels.gemv as gemv_module  # noqa: E402
from benchmarks.gemv_shapes import SHAPES  # noqa: E402
from benchmarks.graph_timing import graph_ms  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
VARIANTS = [(1, 4, 4), (1, 4, 8), (1, 8, 4), (1, 8, 8), (1, 16, 4), (2, 4, 4), (2, 8, 4), (4, 8, 2)]  # (TILES, WARPS, UNROLL)


class _LaunchAttrValue(ctypes.Structure):  # CUlaunchAttributeValue: a 64-byte union; these launches set one int
    _fields_ = [("flag", ctypes.c_int), ("pad", ctypes.c_char * 60)]


class _LaunchAttr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _LaunchAttrValue)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttr)), ("numAttrs", ctypes.c_uint)]


class CubinKernels:
    def __init__(self, cubin: bytes):
        self.cuda = ctypes.CDLL("libcuda.so.1")
        torch.zeros(1, device="cuda")  # the runtime's primary context exists and is current
        self.module = ctypes.c_void_p()
        self._check(self.cuda.cuModuleLoadData(ctypes.byref(self.module), cubin), "cuModuleLoadData")
        self.functions: dict[str, ctypes.c_void_p] = {}
        self.attr = _LaunchAttr()
        self.attr.id = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        self.attr.value.flag = 1

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} failed: CUresult {rc}")

    def function(self, name: str) -> ctypes.c_void_p:
        if name not in self.functions:
            f = ctypes.c_void_p()
            self._check(self.cuda.cuModuleGetFunction(ctypes.byref(f), self.module, name.encode()), name)
            self.functions[name] = f
        return self.functions[name]

    def gemv(self, variant, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, pdl: bool = True) -> None:
        tiles, warps, unroll = variant
        m, k = x.shape
        n = w.shape[0]
        assert m <= 8 and n % (16 * tiles) == 0 and k % (32 * warps * unroll) == 0
        cfg = _LaunchConfig(n // (16 * tiles), 1, 1, 32 * warps, 1, 1, 0, torch.cuda.current_stream().cuda_stream,
                            ctypes.pointer(self.attr) if pdl else None, 1 if pdl else 0)
        args = [ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(w.data_ptr()), ctypes.c_void_p(out.data_ptr()),
                ctypes.c_int(m), ctypes.c_int(k), ctypes.c_int(x.stride(0)), ctypes.c_int(out.stride(0)),
                ctypes.c_int(int(pdl))]
        params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args])
        self._check(self.cuda.cuLaunchKernelEx(ctypes.byref(cfg), self.function(f"gemv_mma_t{tiles}_w{warps}_u{unroll}"),
                                               params, None), "cuLaunchKernelEx")


def build() -> bytes:
    path = os.path.join(tempfile.mkdtemp(), "gemv_mma.cubin")
    subprocess.run(["nvcc", "-gencode=arch=compute_90a,code=sm_90a", "-O3", "-cubin", "-o", path,
                    os.path.join(HERE, "gemv_mma.cu")], check=True)
    return open(path, "rb").read()


def main() -> None:
    kernels = CubinKernels(build())
    lines = ["| shape | 1 row vec | 6 rows dot (engine) | " + " | ".join(f"6 rows mma {v}" for v in VARIANTS) + " |",
             "|---|---|---|" + "---|" * len(VARIANTS)]
    for name, (n, k) in SHAPES.items():
        copies = max(4, min(32, int(6e9 // (n * k * 2))))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        x6 = torch.randn(6, k, device="cuda", dtype=torch.bfloat16)
        x1 = x6[:1].contiguous()
        ref = torch.nn.functional.linear(x6.float(), weights[0].float())
        one = 1000 * graph_ms(lambda: [gemv_module.gemv(x1, w) for w in weights], reps=10) / copies
        six = 1000 * graph_ms(lambda: [gemv_module.gemv(x6, w) for w in weights], reps=10) / copies
        cells = []
        for v in VARIANTS:
            out = torch.full((6, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            two = torch.full((2, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            try:
                kernels.gemv(v, x6, weights[0], out)
                kernels.gemv(v, x6[:2], weights[0], two)
                torch.cuda.synchronize()
                err = ((out.float() - ref).norm() / ref.norm()).item()
                if not err < 1e-2 or not torch.equal(out[:2], two):
                    cells.append(f"wrong (err {err:.1e}, rows equal {torch.equal(out[:2], two)})")
                    continue
                cells.append(f"{1000 * graph_ms(lambda: [kernels.gemv(v, x6, w, out) for w in weights], reps=10) / copies:.1f}")
            except Exception as e:  # a variant that does not fit the shape is reported, not fatal
                cells.append(f"n/a ({type(e).__name__})")
        lines.append(f"| {name} {n}x{k} | {one:.1f} | {six:.1f} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
        weights.clear()
        torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "."), "cuda_gemv.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
