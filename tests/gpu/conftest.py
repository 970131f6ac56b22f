"""GPU tests. Some kernel tests also run on the CPU under Triton's interpreter (TRITON_INTERPRET=1, slowly).

Triton 3.6's interpreter turns a scalar used as a loop bound into a Python int with int() on a one-element array, which
NumPy 2 refuses ("only 0-dimensional arrays can be converted to Python scalars"); the paged-attention kernel's key
loops have runtime bounds, so its tests failed there before running. Under the interpreter only, scalars convert
through their single element instead. Nothing changes on a GPU.
"""

from __future__ import annotations

import os

if os.environ.get("TRITON_INTERPRET") == "1":
    import triton.runtime.interpreter as _interpreter

    _patch_lang_tensor = _interpreter._patch_lang_tensor

    def _with_scalar_index(tensor, scope) -> None:
        _patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", _scalar_index)

    def _scalar_index(self) -> int:
        data = self.handle.data
        return int(data.reshape(-1)[0]) if data.size == 1 else int(data)  # a block still fails as before

    _interpreter._patch_lang_tensor = _with_scalar_index
