"""A GGUF file's metadata and tensor directory, parsed straight from its memory map.

The gguf package's `GGUFReader` builds a numpy view for every part of every metadata value: SmolLM2's
49k-token vocabulary and 49k merges take it ~6 s. Here each string array is one loop over the bytes
(~0.1 s) and each numeric array one `frombuffer`. Tensor data stay in the memory map (read-only) until a
tensor is read; the gguf package still names the tensor types and dequantizes them.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
# Value types: (struct format, numpy dtype) of the scalar ones; 8 is a string, 9 an array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# Tensor types held as plain numbers (any other is quantized: raw bytes, one row of blocks per last axis).
_PLAIN = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}


class GGUFFormatError(ValueError):
    """The bytes are not a GGUF file jaxserve can read (named: truncated, wrong magic, unknown type)."""


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor's directory entry; `data` is its bytes in the memory map as the gguf package lays them out
    (plain types as numbers of shape reversed(`shape`), quantized ones as uint8 rows of blocks)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: the fastest-varying dimension first
    n_bytes: int
    data_offset: int
    _buffer: Any

    @property
    def data(self) -> np.ndarray:
        import gguf

        dims = tuple(reversed(self.shape))
        plain = _PLAIN.get(int(self.tensor_type))
        if plain is not None:
            return np.frombuffer(self._buffer, plain, self.n_bytes // np.dtype(plain).itemsize,
                                 self.data_offset).reshape(dims)
        raw = np.frombuffer(self._buffer, np.uint8, self.n_bytes, self.data_offset)
        return raw.reshape(gguf.quant_shape_to_byte_shape(dims, self.tensor_type))


class GGUFHeader:
    """The metadata (`values`: key -> Python value, arrays as lists) and tensors of the GGUF file at `path`."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        try:
            self._parse()
        except (struct.error, IndexError, UnicodeDecodeError, OverflowError) as e:
            raise GGUFFormatError(f"cannot parse the GGUF header at byte {self._pos}: {e}") from e

    def _parse(self) -> None:
        import gguf

        if self._map[:4] != _MAGIC:
            raise GGUFFormatError(f"not a GGUF file (magic {bytes(self._map[:4])!r}, expected {_MAGIC!r})")
        version = struct.unpack_from("<I", self._map, 4)[0]
        self._order = "<" if version < 0x10000 else ">"  # a big-endian file's version reads byte-swapped
        self.version = version if self._order == "<" else struct.unpack_from(">I", self._map, 4)[0]
        if self.version not in (2, 3):
            raise GGUFFormatError(f"GGUF version {self.version} is not supported (2 or 3)")
        self._pos = 8
        n_tensors, n_values = self._unpack("QQ")
        self.values: dict[str, Any] = {}
        for _ in range(n_values):
            key = self._string()
            self.values[key] = self._value(self._unpack("I")[0])
        entries = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._unpack("I")
            dims = self._unpack("Q" * n_dims)
            kind, offset = self._unpack("IQ")
            entries.append((name, dims, kind, offset))
        alignment = int(self.values.get("general.alignment", 32))
        start = -(-self._pos // alignment) * alignment
        self.tensors: list[GGUFTensor] = []
        seen: set[str] = set()
        for name, dims, kind, offset in entries:
            if name in seen:
                raise GGUFFormatError(f"tensor {name!r} appears twice")
            seen.add(name)
            try:
                qtype = gguf.GGMLQuantizationType(kind)
            except ValueError:
                raise GGUFFormatError(f"tensor {name!r} has unknown type {kind}") from None
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            n_bytes = int(np.prod(dims, dtype=np.int64)) * type_size // block
            self.tensors.append(GGUFTensor(name, qtype, tuple(int(d) for d in dims), n_bytes, start + offset,
                                           self._map))

    def _unpack(self, fmt: str) -> tuple:
        out = struct.unpack_from(self._order + fmt, self._map, self._pos)
        self._pos += struct.calcsize(self._order + fmt)
        return out

    def _string(self) -> str:
        (n,) = self._unpack("Q")
        start, self._pos = self._pos, self._pos + n
        if self._pos > len(self._map):
            raise IndexError(f"a string of {n} bytes runs past the end of the file")
        return self._map[start:self._pos].decode("utf-8")

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item, count = self._unpack("IQ")
            if item == _STRING:
                return self._strings(count)
            if item in _SCALARS:
                dtype = np.dtype(self._order + _SCALARS[item]) if item != 7 else np.dtype(np.bool_)
                values = np.frombuffer(self._map, dtype, count, self._pos)
                self._pos += count * dtype.itemsize
                return values.tolist()
            return [self._value(item) for _ in range(count)]
        if kind in _SCALARS:
            return self._unpack(_SCALARS[kind])[0]
        raise GGUFFormatError(f"unknown GGUF value type {kind}")

    def _strings(self, count: int) -> list[str]:
        buf, pos, out = self._map, self._pos, []
        little = self._order == "<"
        for _ in range(count):
            n = int.from_bytes(buf[pos:pos + 8], "little" if little else "big")
            pos += 8
            out.append(buf[pos:pos + n].decode("utf-8"))
            pos += n
        if pos > len(buf):
            raise IndexError(f"a string array of {count} runs past the end of the file")
        self._pos = pos
        return out

    @cached_property
    def data_end(self) -> int:
        """The byte just past the last tensor's data."""
        return max((t.data_offset + t.n_bytes for t in self.tensors), default=0)
