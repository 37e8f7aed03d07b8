"""A GGUF file's metadata and tensors, read in one pass over its header.

The gguf package's GGUFReader builds a numpy view for every part of every metadata value:
for a 150k-token vocabulary (its tokens, types and merges) that is millions of memmap
slices, 6.5 s for Qwen2.5-1.5B and 2.3 s for the default model, before any weight is
touched. This reader decodes the header with `struct` and numpy's frombuffer, keeps the
metadata as plain Python values, and maps the tensors' data without copying it. The gguf
package still names the tensor types and dequantizes (runtime.models.loader).

Layout (GGUF v2 and v3, little-endian): magic "GGUF", version u32, tensor count u64,
metadata count u64; the metadata (key string, value type u32, value); one record per
tensor (name string, dimension count u32, dimensions u64 innermost first, type u32,
offset u64 from the data section); the data section, at the next multiple of
`general.alignment` (32 by default).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# metadata value type -> (struct format, numpy dtype) of the scalar types
_SCALARS = {0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
            4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
            10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64)}
_STRING, _ARRAY = 8, 9
# tensor types stored as plain arrays; the others are blocks of bytes
_PLAIN = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
          GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
          GGMLQuantizationType.I64: np.int64}


class GGUFFormatError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # ggml's order: innermost first
    data: np.ndarray  # read-only view of the file: numpy's order (outermost first); blocks as uint8 rows


class GGUFFile:
    """`metadata`: key -> int, float, bool, str or list of them; `tensors`: in file order."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._bytes = np.frombuffer(np.memmap(self.path, dtype=np.uint8, mode="r"), np.uint8)  # read-only
        self._buf = memoryview(self._bytes)
        self._offset = 0
        try:
            tensor_records, data_start = self._read_header()
            self.tensors = [self._tensor(*record, data_start) for record in tensor_records]
        except (struct.error, IndexError, UnicodeDecodeError) as e:
            raise GGUFFormatError(f"{self.path}: not a readable GGUF file ({e})") from None

    # ---- header -------------------------------------------------------------------------
    def _read_header(self) -> tuple[list[tuple], int]:
        if bytes(self._buf[:4]) != MAGIC:
            raise GGUFFormatError(f"{self.path}: not a GGUF file (no GGUF magic)")
        self._offset = 4
        version, = self._unpack("<I")
        if version not in VERSIONS:
            raise GGUFFormatError(f"{self.path}: GGUF version {version} (big-endian, or too old) is not supported; "
                                  f"supported: little-endian versions {', '.join(map(str, VERSIONS))}")
        num_tensors, num_metadata = self._unpack("<QQ")
        self.metadata = {}
        for _ in range(num_metadata):
            key = self._string()
            self.metadata[key] = self._value(*self._unpack("<I"))
        records = [self._tensor_record() for _ in range(num_tensors)]
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        return records, -(-self._offset // alignment) * alignment

    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self._buf, self._offset)
        self._offset += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        length, = self._unpack("<Q")
        start = self._offset
        self._offset += length
        return str(self._buf[start:self._offset], "utf-8")

    def _value(self, value_type: int):
        if value_type == _STRING:
            return self._string()
        if value_type == _ARRAY:
            item_type, count = self._unpack("<IQ")
            return self._array(item_type, count)
        if value_type not in _SCALARS:
            raise GGUFFormatError(f"{self.path}: unknown metadata value type {value_type}")
        return self._unpack(_SCALARS[value_type][0])[0]

    def _array(self, item_type: int, count: int) -> list:
        if item_type in _SCALARS:  # one frombuffer for the whole array
            dtype = np.dtype(_SCALARS[item_type][1]).newbyteorder("<")
            values = np.frombuffer(self._buf, dtype, count, self._offset)
            self._offset += values.nbytes
            return values.tolist()
        return [self._value(item_type) for _ in range(count)]

    def _tensor_record(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        num_dims, = self._unpack("<I")
        shape = self._unpack(f"<{num_dims}Q")
        raw_type, offset = self._unpack("<IQ")
        return name, shape, raw_type, offset

    # ---- tensors ------------------------------------------------------------------------
    def _tensor(self, name: str, shape: tuple[int, ...], raw_type: int, offset: int, data_start: int) -> GGUFTensor:
        try:
            tensor_type = GGMLQuantizationType(raw_type)
        except ValueError:
            raise GGUFFormatError(f"{self.path}: GGUF tensor {name} has unknown type {raw_type}") from None
        block_size, type_size = GGML_QUANT_SIZES[tensor_type]
        numpy_shape = tuple(reversed(shape))  # outermost first
        if numpy_shape and numpy_shape[-1] % block_size:
            raise GGUFFormatError(f"{self.path}: GGUF tensor {name}: rows of {numpy_shape[-1]} values are not "
                                  f"whole {tensor_type.name} blocks of {block_size}")
        num_bytes = int(np.prod(numpy_shape, dtype=np.int64)) // block_size * type_size
        start = data_start + offset
        if start + num_bytes > len(self._bytes):
            raise GGUFFormatError(f"{self.path}: GGUF tensor {name} runs past the end of the file")
        data = self._bytes[start:start + num_bytes]
        if tensor_type in _PLAIN:
            data = data.view(np.dtype(_PLAIN[tensor_type]).newbyteorder("<")).reshape(numpy_shape)
        else:
            data = data.reshape(*numpy_shape[:-1], numpy_shape[-1] // block_size * type_size)
        return GGUFTensor(name, tensor_type, shape, data)
