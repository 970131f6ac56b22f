"""CUDA C kernels (the .cu files beside this one), built with nvcc on first use and launched through the CUDA driver
API (ctypes, no torch extension build), with programmatic dependent launch like the Triton kernels (pdl.py).

Triton serves every kernel but one: the few-row tensor-core GEMV (gemv_mma.cu), whose weight operands must go from
global memory straight into MMA registers, which Triton's layouts do not express. Where nvcc is missing, the build
fails or the GPU is not one it was measured on, `module()` returns None and the Triton kernel runs instead (logged
once). The cubin is cached under options.cache_dir() ($HYPERDRAFT_CACHE), keyed by the source and the GPU
architecture. RuntimeOptions.cuda_kernels (HYPERDRAFT_DISABLE_CUDA_KERNELS=1) turns them off (A/B measurements).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile

import torch

from hyperdraft import options

logger = logging.getLogger("hyperdraft")
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gemv_mma.cu")
MEASURED_ARCHS = {(9, 0)}  # H100 / H200: where gemv_mma.cu was measured against the Triton kernel
_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID


class _AttrValue(ctypes.Structure):  # CUlaunchAttributeValue: a 64-byte union; these launches set one int in it
    _fields_ = [("flag", ctypes.c_int), ("pad", ctypes.c_char * 60)]


class _Attr(ctypes.Structure):  # CUlaunchAttribute
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _AttrValue)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_Attr)),
                ("num_attrs", ctypes.c_uint)]


class CudaModule:
    """One cubin loaded into the device's primary context (the one torch uses)."""

    def __init__(self, cubin: bytes, device: torch.device):
        self.index = device.index
        self.driver = ctypes.CDLL("libcuda.so.1")
        with torch.cuda.device(device):
            torch.cuda.init()
            torch.empty(1, device=device)  # the primary context exists and is current on this thread
            self.handle = ctypes.c_void_p()
            _check(self.driver.cuModuleLoadData(ctypes.byref(self.handle), cubin), "cuModuleLoadData")
        self.functions: dict[str, ctypes.c_void_p] = {}
        self.pdl_attr = _Attr(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
        self.pdl_attr.value.flag = 1

    def launch(self, name: str, grid: int, threads: int, args: list, stream: torch.cuda.Stream, pdl: bool) -> None:
        """args: ctypes scalars (pointers as c_void_p), in the kernel's parameter order."""
        fn = self.functions.get(name)
        if fn is None:
            fn = ctypes.c_void_p()
            _check(self.driver.cuModuleGetFunction(ctypes.byref(fn), self.handle, name.encode()), name)
            self.functions[name] = fn
        cfg = _LaunchConfig(grid, 1, 1, threads, 1, 1, 0, stream.cuda_stream,
                            ctypes.pointer(self.pdl_attr) if pdl else None, int(pdl))
        params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args])
        if torch.cuda.current_device() == self.index:
            _check(self.driver.cuLaunchKernelEx(ctypes.byref(cfg), fn, params, None), f"launch {name}")
        else:  # the driver launches in the current context: make it this device's (torch's primary context)
            with torch.cuda.device(self.index):
                _check(self.driver.cuLaunchKernelEx(ctypes.byref(cfg), fn, params, None), f"launch {name}")


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"CUDA driver call {what} failed with CUresult {rc}")


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    path = os.path.join(options.cuda_home(), "bin", "nvcc")
    return path if os.path.exists(path) else None


def _build(arch: str) -> bytes:
    source = open(SOURCE, "rb").read()
    cache = os.path.join(options.cache_dir(), "cubin")
    path = os.path.join(cache, f"gemv_mma_{hashlib.sha256(source).hexdigest()[:16]}_sm{arch}.cubin")
    if not os.path.exists(path):
        nvcc = _nvcc()
        if nvcc is None:
            raise RuntimeError("nvcc not found (PATH, CUDA_HOME)")
        os.makedirs(cache, exist_ok=True)
        tmp = tempfile.NamedTemporaryFile(dir=cache, suffix=".cubin", delete=False).name
        subprocess.run([nvcc, f"-gencode=arch=compute_{arch},code=sm_{arch}", "-O3", "-cubin", "-o", tmp, SOURCE],
                       check=True, capture_output=True)
        os.replace(tmp, path)  # atomic: concurrent builders never read half a file
    return open(path, "rb").read()


def module(device: torch.device) -> CudaModule | None:
    """The loaded CUDA kernels for this device, or None (Triton kernels run instead, also where the active
    RuntimeOptions turn them off)."""
    if device.type != "cuda" or not options.current().cuda_kernels:
        return None
    return _load(device)


@functools.cache
def _load(device: torch.device) -> CudaModule | None:
    index = device.index if device.index is not None else torch.cuda.current_device()
    capability = torch.cuda.get_device_capability(index)
    if capability not in MEASURED_ARCHS:
        return None
    try:
        return CudaModule(_build(f"{capability[0]}{capability[1]}"), torch.device("cuda", index))
    except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
        detail = (e.stderr or b"") if isinstance(e, subprocess.CalledProcessError) else b""
        logger.warning("CUDA kernels unavailable, the Triton GEMV runs instead: %s %s", e,
                       detail.decode(errors="replace")[-500:])
        return None
