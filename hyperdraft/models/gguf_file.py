"""A GGUF file's header (metadata and tensor directory) read in one pass, with tensor bytes mapped lazily.

Why not `gguf.GGUFReader`: it wraps every scalar of the header in a numpy memmap view, so the tokenizer metadata
of SmolLM2 (49k token strings and 48k merges) takes 6.2 s to parse on a CI core, paid on every model load. This
reader walks the same layout with `struct` over the header bytes (0.1 s) and maps tensor data with one memmap.

Layout (GGUF v2/v3, little-endian): magic "GGUF", u32 version, u64 tensor count, u64 metadata count; metadata as
(string key, u32 type, value); tensor infos as (string name, u32 n_dims, u64 dims innermost first, u32 GGML type,
u64 offset); tensor data from the first multiple of `general.alignment` (default 32) after the infos.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32, 7: np.bool_,
          10: np.uint64, 11: np.int64, 12: np.float64}
_TYPED_DATA = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
               "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # innermost first, as GGUF stores it
    tensor_type: Any  # gguf.GGMLQuantizationType
    data_offset: int
    n_bytes: int
    data: np.ndarray  # read-only map: typed [rows..., cols] for float/int types, bytes [rows..., row bytes] otherwise


@dataclass(frozen=True)
class GGUFFile:
    metadata: dict[str, Any]  # arrays as lists, strings decoded
    tensors: list[GGUFTensor]


class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str):
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError("a string runs past the end of the file")
        text = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8")
        self.pos += n
        return text

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.unpack("<I"), self.unpack("<Q")
            if item == _STRING:
                return [self.string() for _ in range(count)]
            if item in _NUMPY:
                width = np.dtype(_NUMPY[item]).itemsize
                if self.pos + count * width > len(self.buf):
                    raise ValueError("an array runs past the end of the file")
                values = np.frombuffer(self.buf, _NUMPY[item], count, self.pos).tolist()
                self.pos += count * width
                return values
            return [self.value(item) for _ in range(count)]
        if kind not in _SCALARS:
            raise ValueError(f"unknown GGUF metadata type {kind}")
        return self.unpack(_SCALARS[kind])


def read_gguf(path: str) -> GGUFFile:
    """Parse path's header and map its tensors. Malformed bytes raise ValueError (or struct.error, which the
    caller reports as one)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    raw = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(raw))
    if bytes(cur.buf[:4]) != b"GGUF":
        raise ValueError("no GGUF magic")
    cur.pos = 4
    version, n_tensors, n_fields = cur.unpack("<I"), cur.unpack("<Q"), cur.unpack("<Q")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
    metadata = {}
    for _ in range(n_fields):
        key = cur.string()
        metadata[key] = cur.value(cur.unpack("<I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = tuple(cur.unpack("<Q") for _ in range(cur.unpack("<I")))
        infos.append((name, dims, GGMLQuantizationType(cur.unpack("<I")), cur.unpack("<Q")))
    alignment = int(metadata.get("general.alignment", 32))
    if alignment < 1:
        raise ValueError(f"general.alignment must be >= 1, got {alignment}")
    start = -(-cur.pos // alignment) * alignment
    tensors, names = [], set()
    for name, dims, kind, offset in infos:
        if name in names:
            raise ValueError(f"tensor {name} appears twice")
        names.add(name)
        block, type_size = GGML_QUANT_SIZES[kind]
        n_bytes = int(np.prod(dims, dtype=np.int64)) * type_size // block
        begin = start + offset
        if offset % alignment:
            raise ValueError(f"tensor {name}'s offset {offset} is not a multiple of general.alignment={alignment}")
        if begin + n_bytes > raw.size:
            raise ValueError(f"tensor {name} runs past the end of the file")
        rows_first = tuple(reversed(dims))
        data = raw[begin:begin + n_bytes]
        if kind.name in _TYPED_DATA:
            data = data.view(_TYPED_DATA[kind.name]).reshape(rows_first)
        else:
            data = data.reshape(quant_shape_to_byte_shape(rows_first, kind))
        tensors.append(GGUFTensor(name, dims, kind, begin, n_bytes, data))
    # Each tensor's bytes its own (llama.cpp lays them back to back): an offset into another tensor's data loaded
    # that tensor's weights twice, without a word.
    spans = sorted((t.data_offset, t.data_offset + t.n_bytes, t.name) for t in tensors)
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
        if begin < end:
            raise ValueError(f"tensors {first} and {second} overlap in the file")
    return GGUFFile(metadata, tensors)
