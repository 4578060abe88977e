"""A GGUF file's header, read in one pass: metadata values and tensor views.

Owns `GGUFFile`. gguf-py's `GGUFReader` builds a numpy view for every element of every
metadata array; on SmolLM2-135M's file (two vocabulary arrays of 49,152 entries and 48,900
merges) that took 4.3 s of each engine start (2 cores, 2026-12-04), twice per start. Here
arrays are skipped over and only their lengths kept, except where a caller asks for one by
key; scalars and strings are decoded. Tensors are views of the mapped file laid out as
`GGUFReader` lays them out (F32/F16/... as typed arrays of the reversed dims, quantized
types as bytes with the last dim in bytes), so `gguf.quants.dequantize` takes them as they
are; gguf-py stays the source of the type constants and of dequantization.

Little-endian GGUF v2/v3 only (what llama.cpp writes); anything else is refused by name.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGUF value types -> struct format (the fixed-size ones); 8 = string, 9 = array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# typed (unquantized) tensor types -> numpy dtype; every other type is read as bytes
_TYPED = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}


@dataclass
class GGUFTensor:
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: dims[0] varies fastest
    data: np.ndarray  # a read-only view of the mapped file, in GGUFReader's layout


@dataclass
class ArrayInfo:
    """A metadata array not decoded: its element type and length."""

    element_type: int
    length: int


class GGUFFile:
    """`fields`: key -> decoded scalar or string, or ArrayInfo for arrays (decoded lists for
    the keys in `arrays`); `tensors` in file order."""

    def __init__(self, path: str | Path, arrays: tuple[str, ...] = ()):
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = Path(path)
        # plain ndarray views of the mapping: numpy's memmap subclass costs every slice that
        # dequantization takes a hook call (1.44 -> 0.83 s for SmolLM2's 272 tensors)
        self._buf = np.memmap(self.path, mode="r").view(np.ndarray)
        self._raw = memoryview(self._buf)
        if bytes(self._raw[:4]) != MAGIC:
            raise ValueError(f"{self.path} is not a GGUF file (no GGUF magic)")
        (version,) = struct.unpack_from("<I", self._raw, 4)
        if version not in (2, 3):
            raise ValueError(f"{self.path}: GGUF version {version} is not supported (little-endian v2/v3)")
        n_tensors, n_kv = struct.unpack_from("<QQ", self._raw, 8)
        self._off = 24
        self.fields: dict[str, object] = {}
        for _ in range(n_kv):
            key = self._string()
            (vtype,) = self._unpack("<I")
            self.fields[key] = self._value(vtype, decode_array=key in arrays)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            dims = self._unpack(f"<{n_dims}Q")
            ttype, offset = self._unpack("<IQ")
            infos.append((name, dims, ttype, offset))
        align = int(self.fields.get("general.alignment", DEFAULT_ALIGNMENT))
        if align <= 0 or align & (align - 1):
            raise ValueError(f"{self.path}: invalid alignment {align}")
        start = -(-self._off // align) * align
        self.tensors = []
        for name, dims, ttype, offset in infos:
            qtype = GGMLQuantizationType(ttype)
            n = int(np.prod(dims))
            np_dims = tuple(reversed(dims))
            at = start + offset
            if ttype in _TYPED:
                dtype = np.dtype(_TYPED[ttype])
                data = self._buf[at : at + n * dtype.itemsize].view(dtype).reshape(np_dims)
            else:
                block, size = GGML_QUANT_SIZES[qtype]
                nbytes = n * size // block
                byte_dims = (*np_dims[:-1], np_dims[-1] * size // block)
                data = self._buf[at : at + nbytes].reshape(byte_dims)
            self.tensors.append(GGUFTensor(name, qtype, tuple(dims), data))

    def _unpack(self, fmt: str) -> tuple:
        out = struct.unpack_from(fmt, self._raw, self._off)
        self._off += struct.calcsize(fmt)
        return out

    def _string(self) -> str:
        (n,) = self._unpack("<Q")
        s = bytes(self._raw[self._off : self._off + n]).decode("utf-8")
        self._off += n
        return s

    def _value(self, vtype: int, decode_array: bool = False):
        if vtype in _SCALARS:
            return self._unpack("<" + _SCALARS[vtype])[0]
        if vtype == _STRING:
            return self._string()
        if vtype != _ARRAY:
            raise ValueError(f"{self.path}: unknown GGUF value type {vtype}")
        etype, count = self._unpack("<IQ")
        if decode_array:
            return [self._value(etype) for _ in range(count)]
        if etype in _SCALARS:
            self._off += count * struct.calcsize("<" + _SCALARS[etype])
        elif etype == _STRING:  # only the lengths are read (a vocabulary: 50 ms, not 4 s)
            raw, off = self._raw, self._off
            for _ in range(count):
                off += 8 + struct.unpack_from("<Q", raw, off)[0]
            self._off = off
        else:  # nested arrays: walked, not kept
            for _ in range(count):
                self._value(etype)
        return ArrayInfo(etype, count)
