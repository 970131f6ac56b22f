"""kernels/cuda_kernels.py on a machine without a GPU: the CUDA C source builds with nvcc into a cubin that holds
every kernel gemv.py launches, the ctypes mirrors of the driver's launch structs have the C layout, and no GPU means
no CUDA module (gemv then runs Triton). The kernels' numbers are checked on a GPU: tests/gpu/test_gemv.py."""

from __future__ import annotations

import ctypes

import pytest
import torch

from hyperdraft.kernels import cuda_kernels

needs_nvcc = pytest.mark.skipif(cuda_kernels._nvcc() is None, reason="nvcc is not installed on this machine")


@needs_nvcc
def test_source_builds_a_cubin_with_every_kernel_gemv_launches(tmp_path, monkeypatch):
    monkeypatch.setenv("HYPERDRAFT_CACHE", str(tmp_path))
    cubin = cuda_kernels._build("90")
    assert cubin[:4] == b"\x7fELF"
    for dtype in ("bf16", "f16"):
        for rows in (8, 16):
            assert f"gemv_mma_{dtype}_rows{rows}".encode() in cubin
    cached = list((tmp_path / "cubin").iterdir())
    assert len(cached) == 1 and cached[0].name.endswith("_sm90.cubin")
    assert cuda_kernels._build("90") == cubin  # the second call reads the cache


def test_launch_structs_have_the_driver_layout():
    """CUlaunchAttribute is {int id; char pad[4]; union value[64]} and CUlaunchConfig seven uints, a stream, the
    attribute pointer and their count (cuda.h): a wrong offset would pass garbage to cuLaunchKernelEx."""
    assert ctypes.sizeof(cuda_kernels._Attr) == 72 and cuda_kernels._Attr.value.offset == 8
    cfg = cuda_kernels._LaunchConfig
    assert (cfg.stream.offset, cfg.attrs.offset, cfg.num_attrs.offset, ctypes.sizeof(cfg)) == (32, 40, 48, 56)
    attr = cuda_kernels._Attr(id=6)
    attr.value.flag = 1
    assert bytes(attr)[:12] == b"\x06\x00\x00\x00\x00\x00\x00\x00\x01\x00\x00\x00"


def test_no_cuda_module_off_the_gpu():
    """Off the GPU there is no module, so gemv's dispatch never picks the CUDA kernel, even for a shape it fits."""
    from hyperdraft.kernels.gemv import mma_fits

    assert cuda_kernels.module(torch.device("cpu")) is None
    x = torch.zeros(6, 1024, dtype=torch.bfloat16)
    assert not mma_fits(x, torch.zeros(16, 1024, dtype=torch.bfloat16), None)
