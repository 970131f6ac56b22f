"""HostReadCounter: records the tensor operations that, on a CUDA tensor, copy device data to the host or block on it.

On CPU none of them costs anything, so a CPU test cannot time them; but each one here is a device-to-host sync on a
GPU (or a pageable host-to-device copy, which also synchronizes), so counting them while the engine runs on CPU
finds them without a GPU:

  read        item, tolist, numpy, cpu, bool()/int()/float()/index() of a tensor (`if t:`, `range(t)`, ...)
  nonzero     nonzero, argwhere, boolean-mask indexing x[mask] (the result's size is data), masked_select, unique,
              repeat_interleave with tensor repeats and no output_size
  scalar_put  x[tensor_index] = python_scalar: on CUDA the scalar becomes a CPU tensor that index_put_ copies to the
              device synchronously (pageable host-to-device)

It is a TorchFunctionMode: it sees every torch call made from Python (tensor methods, operators, torch.* functions)
without patching anything, and records (kind, op, caller file:line). Calls torch makes from C++ are not seen; every
such call the engine makes goes through Python first.
"""

from __future__ import annotations

import os
import sys

import torch
from torch.overrides import TorchFunctionMode

_READS = {"item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__"}
_NONZERO = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive"}
_TORCH_DIR = os.path.dirname(torch.__file__)


class HostReadCounter(TorchFunctionMode):
    def __init__(self, ignore_files: tuple[str, ...] = ()):
        """ignore_files: calls made from files whose path ends with one of these are not recorded (e.g. the CPU
        attention backend, which a GPU never runs)."""
        super().__init__()
        self.ignore_files = ignore_files
        self.events: list[tuple[str, str, str]] = []  # (kind, op, caller file:line)

    def clear(self) -> None:
        self.events.clear()

    def kinds(self) -> list[str]:
        return [f"{kind}:{op}" for kind, op, _ in self.events]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind, op = _classify(getattr(func, "__name__", ""), args, kwargs)
        if kind is not None:
            self._record(kind, op)
        return func(*args, **kwargs)

    def _record(self, kind: str, op: str) -> None:
        frame = sys._getframe(2)
        while frame is not None and (frame.f_code.co_filename == __file__
                                     or frame.f_code.co_filename.startswith(_TORCH_DIR)):
            frame = frame.f_back
        where = "?" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"
        if self.ignore_files and where.split(":")[0].endswith(self.ignore_files):
            return
        self.events.append((kind, op, where))


def _classify(name: str, args: tuple, kwargs: dict) -> tuple[str | None, str]:
    if name in _READS:
        return "read", name
    if name in _NONZERO:
        return "nonzero", name
    if name == "repeat_interleave":
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        sized = kwargs.get("output_size") is not None or len(args) > 3
        if isinstance(repeats, torch.Tensor) and repeats.numel() > 1 and not sized:
            return "nonzero", name
    if name == "__getitem__" and len(args) > 1 and _has_mask(args[1]):
        return "nonzero", "x[mask]"
    if name == "__setitem__" and len(args) > 2:
        if _has_mask(args[1]):
            return "nonzero", "x[mask] = v"
        if isinstance(args[2], (bool, int, float)) and _has_tensor(args[1]):
            return "scalar_put", "x[tensor] = scalar"
    return None, name


def _parts(index) -> tuple:
    return index if isinstance(index, tuple) else (index,)


def _has_tensor(index) -> bool:
    return any(isinstance(i, torch.Tensor) for i in _parts(index))


def _has_mask(index) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in _parts(index))


def reads_per_step(engine, ignore_files: tuple[str, ...] = ()) -> list[list[str]]:
    """Step the engine until its requests finish -> for each step that ran, its device-to-host reads ("kind:op at
    file:line")."""
    per_step = []
    with HostReadCounter(ignore_files=ignore_files) as counter:
        while engine.has_unfinished():
            counter.clear()
            if engine.step():
                per_step.append([f"{k} at {e[2]}" for k, e in zip(counter.kinds(), counter.events)])
    return per_step


def assert_one_read_per_step(per_step: list[list[str]]) -> None:
    """Every step read the device once: the results' copy (HostCopy.wait's tolist)."""
    assert per_step and all(len(reads) == 1 and reads[0].startswith("read:tolist") for reads in per_step), \
        [r for r in per_step if len(r) != 1][:3]
