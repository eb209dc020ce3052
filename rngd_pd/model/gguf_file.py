"""A GGUF file's metadata and tensor index, decoded in one pass with `struct`.

gguf's `GGUFReader` builds a numpy memmap view for every part of every metadata value: for the
embedded SmolLM2 (a 49k-token vocabulary and 49k merges) that is ~740k views and 2-3 s of CPU per
open. Every model stub pays it at start (prefill, decode and colocated open the checkpoint twice,
pre/postprocess once), as do the front end, `rngd-pd devices` (once per model) and each test that
loads the model. Here the metadata is decoded straight from the memory-mapped bytes (~0.1 s), and each
tensor is a numpy view of the mapping shaped as `GGUFReader` shapes it (typed for float and integer
types, bytes per row for quantized ones), so `gguf.quants.dequantize` takes it unchanged. gguf stays
the authority on the format's constants (value and quantization types, block sizes);
`dequantize` gives `gguf.quants.dequantize`'s values with the same per-block numpy operations, over
chunks of ~8M values instead of gguf's groups of 16 rows (for a 576-wide model ~300 blocks a call: two
of the three seconds of a load went to that loop's overhead).
tests/test_model_gguf_file.py checks every field, tensor and dequantized value against gguf's own
functions on the embedded model.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, quants
from gguf.constants import GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC
from gguf.quants import quant_shape_from_byte_shape, quant_shape_to_byte_shape

VERSIONS = (2, 3)
_SCALARS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}
# Tensor types stored as plain numpy items (the rest are quantized blocks, read as bytes per row).
_PLAIN: dict[GGMLQuantizationType, type] = {
    GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


DEQUANT_VALUES = 1 << 23  # values per dequantize step: vectorized, and a bounded transient for 8B models


def dequantize(data: np.ndarray, kind: GGMLQuantizationType) -> np.ndarray:
    """fp32 values of a tensor's data (as GGUFTensor.data holds it), bit for bit gguf's."""
    quant = getattr(quants, kind.name, None)  # gguf names each block format's class after its type
    if kind in _PLAIN or not hasattr(quant, "dequantize_rows"):
        return quants.dequantize(data, kind)
    quant.init_grid()  # the lattice-based formats' tables (a no-op for the others), as gguf does first
    rows = data.reshape(-1, data.shape[-1])
    width = quant_shape_from_byte_shape(rows.shape, kind)[-1]
    out = np.empty((rows.shape[0], width), np.float32)
    step = max(1, DEQUANT_VALUES // width)
    for i in range(0, rows.shape[0], step):
        out[i:i + step] = quant.dequantize_rows(rows[i:i + step])
    return out.reshape(quant_shape_from_byte_shape(data.shape, kind))


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: its GGUF name, type, and data (a read-only view of the file)."""

    name: str
    tensor_type: GGMLQuantizationType
    data: np.ndarray


class _Cursor:
    """Reads little- or big-endian values from a buffer, advancing an offset."""

    def __init__(self, buf: Any, order: str) -> None:
        self.buf, self.order, self.pos = buf, order, 0

    def unpack(self, code: str) -> tuple[Any, ...]:
        try:
            values = struct.unpack_from(self.order + code, self.buf, self.pos)
        except struct.error:
            raise ValueError("the file ends inside its metadata (truncated)") from None
        self.pos += struct.calcsize(self.order + code)
        return values

    def scalar(self, code: str) -> Any:
        return self.unpack(code)[0]

    def string(self) -> str:
        n = self.scalar("Q")
        self.pos += n
        if self.pos > len(self.buf):
            raise ValueError("the file ends inside its metadata (truncated)")
        return bytes(self.buf[self.pos - n:self.pos]).decode("utf-8")

    def value(self, kind: GGUFValueType) -> Any:
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind == GGUFValueType.ARRAY:
            item, count = GGUFValueType(self.scalar("I")), self.scalar("Q")
            if item in _SCALARS:  # one unpack for the whole array (49k token types at once)
                return list(self.unpack(f"{count}{_SCALARS[item]}"))
            return [self.value(item) for _ in range(count)]
        return self.scalar(_SCALARS[kind])


class GGUFFile:
    """A GGUF file opened read-only: `fields` (key -> Python value, as `ReaderField.contents()` gives
    it) and `tensors` (in file order). ValueError on anything that is not a GGUF file it can read."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.data = np.memmap(self.path, mode="r")
        buf = memoryview(self.data)
        if len(buf) < 24 or struct.unpack_from("<I", buf)[0] != GGUF_MAGIC:
            raise ValueError("GGUF magic invalid")
        self.order = "<" if struct.unpack_from("<I", buf, 4)[0] & 0xFFFF else ">"  # low half 0: swapped
        cur = _Cursor(buf, self.order)
        cur.pos = 4
        version = cur.scalar("I")
        if version not in VERSIONS:
            raise ValueError(f"GGUF version {version} is not supported (only {VERSIONS})")
        n_tensors, n_fields = cur.scalar("Q"), cur.scalar("Q")
        self.fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = cur.string()
            self.fields[key] = cur.value(GGUFValueType(cur.scalar("I")))
        infos = [self._tensor_info(cur) for _ in range(n_tensors)]
        align = self.fields.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if align <= 0 or align & (align - 1):
            raise ValueError(f"invalid general.alignment {align}: must be a power of two")
        start = -(-cur.pos // align) * align
        self.tensors = [self._tensor(start, *info) for info in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError("duplicated tensor names")

    @staticmethod
    def _tensor_info(cur: _Cursor) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = cur.string()
        dims = tuple(cur.scalar("Q") for _ in range(cur.scalar("I")))
        return name, dims, GGMLQuantizationType(cur.scalar("I")), cur.scalar("Q")

    def _tensor(self, start: int, name: str, dims: tuple[int, ...], kind: GGMLQuantizationType,
                offset: int) -> GGUFTensor:
        shape = tuple(reversed(dims))  # GGUF lists the fastest-moving dimension first
        n = int(np.prod(dims, dtype=np.int64))
        if kind in _PLAIN:
            item, count = np.dtype(_PLAIN[kind]).newbyteorder(self.order), n
        else:
            block, size = GGML_QUANT_SIZES[kind]
            item, count, shape = np.dtype(np.uint8), n * size // block, quant_shape_to_byte_shape(shape, kind)
        begin = start + offset
        end = begin + count * item.itemsize
        if end > len(self.data):
            raise ValueError(f"tensor {name} runs past the end of the file")
        return GGUFTensor(name, kind, self.data[begin:end].view(item).reshape(shape))
