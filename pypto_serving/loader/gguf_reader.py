"""A lean reader of a GGUF file: its metadata and tensor table over one memory map, and
tensors dequantized to float32 with gguf-py's `gguf.quants.dequantize`.

gguf-py's `GGUFReader` builds a numpy view for every string of a vocabulary, which takes
~14 s for Qwen2.5's 152k tokens and merges; walking the header ourselves takes well under a
second. Tensor bytes stay in the page cache until a caller asks for one tensor. Reading the
header needs neither numpy nor gguf-py (the API process reads the tokenizer from here and
stays ~20 MiB smaller without them); dequantizing imports them.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pypto_serving.loader.errors import UnsupportedModel

if TYPE_CHECKING:
    import numpy as np
    from gguf import GGMLQuantizationType

# GGUF metadata value types (the file format's numbering, as gguf-py's GGUFValueType)
_STRING, _ARRAY = 8, 9
_SCALAR_FORMATS = {  # type -> struct code
    0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d",
}
_DEFAULT_ALIGNMENT = 32  # llama.cpp's, when `general.alignment` is absent
_SLICE_ELEMENTS = 1 << 22


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order: the row-contiguous dimension last
    type_id: int  # the raw ggml type id: gguf-py may not know it
    start: int  # absolute byte offset in the file


@dataclass(frozen=True, slots=True)
class GGUFFile:
    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    buffer: mmap.mmap

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor as a fresh, writable float32 array of its `shape`."""
        import numpy as np
        from gguf.quants import quant_shape_to_byte_shape

        info = self.tensors[name]
        qtype = _quant_type(info)
        byte_shape = quant_shape_to_byte_shape(info.shape, qtype)
        if info.start + prod(byte_shape) > len(self.buffer):
            raise UnsupportedModel(f"tensor {name!r} lies past the end of {self.path}: truncated file")
        raw = np.frombuffer(self.buffer, np.uint8, prod(byte_shape), info.start)
        rows, out = raw.reshape(-1, byte_shape[-1]), np.empty(info.shape, np.float32)
        out_rows = out.reshape(-1, info.shape[-1])
        # In slices: gguf-py's intermediates are several times the slice's float32 size.
        step = max(1, _SLICE_ELEMENTS // out_rows.shape[1])
        for start in range(0, len(rows), step):
            out_rows[start : start + step] = _dequantize(info, rows[start : start + step], qtype)
        return out


def read_gguf(path: str | Path) -> GGUFFile:
    """Parses the header of the GGUF file at `path`; tensor data is only mapped."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise UnsupportedModel(f"{path} is not a GGUF file (no GGUF magic bytes)")
        buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        metadata, tensors = _read_header(buffer, path)
    except UnsupportedModel:
        raise
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise UnsupportedModel(f"{path} is not a readable GGUF file (truncated or corrupt: {e})") from e
    return GGUFFile(Path(path), metadata, tensors, buffer)


def _read_header(buf: mmap.mmap, path: str | Path) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
    version, tensor_count, kv_count = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise UnsupportedModel(f"{path} is GGUF version {version}; supported: 2 and 3")
    metadata, pos = _read_metadata(buf, 24, kv_count)
    entries, pos = _read_tensor_table(buf, pos, tensor_count)
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    data_start = -(-pos // alignment) * alignment  # the tensor data starts aligned
    tensors = {name: TensorInfo(name, shape, t, data_start + off) for name, shape, t, off in entries}
    return metadata, tensors


def _read_metadata(buf: mmap.mmap, pos: int, count: int) -> tuple[dict[str, Any], int]:
    metadata: dict[str, Any] = {}
    for _ in range(count):
        key, pos = _read_string(buf, pos)
        (value_type,) = struct.unpack_from("<I", buf, pos)
        metadata[key], pos = _read_value(buf, pos + 4, value_type)
    return metadata, pos


def _scalar_format(value_type: int) -> str:
    if value_type not in _SCALAR_FORMATS:
        raise ValueError(f"unknown metadata value type {value_type}")
    return _SCALAR_FORMATS[value_type]


def _read_value(buf: mmap.mmap, pos: int, value_type: int) -> tuple[Any, int]:
    if value_type == _STRING:
        return _read_string(buf, pos)
    if value_type == _ARRAY:
        item_type, count = struct.unpack_from("<IQ", buf, pos)
        return _read_array(buf, pos + 12, item_type, count)
    fmt = "<" + _scalar_format(value_type)
    return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)


def _read_array(buf: mmap.mmap, pos: int, item_type: int, count: int) -> tuple[list, int]:
    if item_type in (_STRING, _ARRAY):
        items = []
        for _ in range(count):
            item, pos = _read_value(buf, pos, item_type)
            items.append(item)
        return items, pos
    # Numeric arrays (token types, scores) are read in one go: they can hold 150k items.
    fmt = f"<{count}{_scalar_format(item_type)}"
    return list(struct.unpack_from(fmt, buf, pos)), pos + struct.calcsize(fmt)


def _read_string(buf: mmap.mmap, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", buf, pos)
    end = pos + 8 + length
    return buf[pos + 8 : end].decode("utf-8"), end


def _read_tensor_table(buf: mmap.mmap, pos: int, count: int) -> tuple[list[tuple], int]:
    entries = []
    for _ in range(count):
        name, pos = _read_string(buf, pos)
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        type_id, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        # ggml lists the fastest-moving dimension first; torch lists it last.
        entries.append((name, tuple(reversed(dims)), type_id, offset))
    return entries, pos


def _quant_type(info: TensorInfo) -> GGMLQuantizationType:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(info.type_id)
    except ValueError:
        raise UnsupportedModel(_type_message(info, f"unknown type id {info.type_id}")) from None


def _dequantize(info: TensorInfo, rows: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    from gguf.quants import dequantize

    try:
        return dequantize(rows, qtype)
    except NotImplementedError as e:
        raise UnsupportedModel(_type_message(info, qtype.name)) from e


def _type_message(info: TensorInfo, type_name: str) -> str:
    return (
        f"tensor {info.name!r} is stored as ggml type {type_name}, which cannot be dequantized; "
        "supported: F32, F16, BF16 and the quantized types gguf-py implements "
        "(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K, IQ*, TQ*, MXFP4)"
    )
