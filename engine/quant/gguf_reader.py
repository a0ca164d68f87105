"""A GGUF file's metadata and tensor table, read directly: the ``gguf`` package's reader builds Python
objects for every string of the embedded tokenizer (about 5 s for a 49k vocabulary), where serving needs
a handful of numbers and the tensors' offsets. Format: github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
# GGML tensor types tandem reads: name, (elements, bytes) per block.
TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 8: ("Q8_0", 32, 34),
         30: ("BF16", 1, 2)}
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # outermost first (torch's order; the file lists innermost first)
    type_id: int
    data: np.ndarray  # raw bytes [rows, bytes per row], memory-mapped

    @property
    def type_name(self) -> str:
        if self.type_id in TYPES:
            return TYPES[self.type_id][0]
        try:
            from gguf import GGMLQuantizationType

            return GGMLQuantizationType(self.type_id).name
        except (ImportError, ValueError):
            return f"type {self.type_id}"


class GGUFFile:
    """Metadata (``fields``, arrays of strings skipped) and tensors by GGUF name."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._buf = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._mv = memoryview(self._buf)
        self._pos = 0
        if bytes(self._mv[:4]) != MAGIC:
            raise ValueError(f"{self.path} is not a GGUF file")
        version, n_tensors, n_fields = struct.unpack_from("<IQQ", self._mv, 4)
        if version < 2:
            raise ValueError(f"{self.path}: GGUF version {version} is not supported (2 and later are)")
        self._pos = 24
        self.fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = self._string()
            self.fields[key] = self._value(self._u32())
        infos = [self._tensor_info() for _ in range(n_tensors)]
        align = int(self.fields.get("general.alignment", 32))
        start = -(-self._pos // align) * align
        self.tensors = {name: self._tensor(name, dims, kind, start + offset) for name, dims, kind, offset in infos}

    def _read(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self._mv, self._pos)[0]
        self._pos += struct.calcsize(fmt)
        return value

    def _u32(self) -> int:
        return self._read("<I")

    def _string(self) -> str:
        n = self._read("<Q")
        s = bytes(self._mv[self._pos : self._pos + n]).decode("utf-8", errors="replace")
        self._pos += n
        return s

    def _value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            etype, count = self._u32(), self._read("<Q")
            if etype == _STRING:  # the tokenizer's vocabulary and merges: skipped, not decoded
                for _ in range(count):
                    length = self._read("<Q")  # (not `_pos += _read()`: that adds to the old position)
                    self._pos += length
                return None
            if etype in _SCALARS:
                size = struct.calcsize(_SCALARS[etype])
                self._pos += size * count
                return count
            return [self._value(etype) for _ in range(count)]
        if vtype not in _SCALARS:
            raise ValueError(f"{self.path}: unknown GGUF value type {vtype}")
        return self._read(_SCALARS[vtype])

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        dims = tuple(self._read("<Q") for _ in range(self._u32()))
        return name, dims, self._u32(), self._read("<Q")

    def _tensor(self, name: str, dims: tuple[int, ...], type_id: int, start: int) -> GGUFTensor:
        shape = tuple(reversed(dims))
        inner = dims[0]
        rows = int(np.prod(dims[1:])) if len(dims) > 1 else 1
        if type_id in TYPES:
            _, per_block, block_bytes = TYPES[type_id]
        else:  # other formats are read through the gguf package (dequantized)
            from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

            per_block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
        row_bytes = inner // per_block * block_bytes
        data = self._buf[start : start + rows * row_bytes].reshape(rows, row_bytes)
        return GGUFTensor(name, shape, type_id, data)
