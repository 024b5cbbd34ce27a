"""The one table of torch dtypes: element sizes, the names formats give them, and element bytes.

Readers use it to size storages and to allowlist the ``torch.<dtype>`` globals a pickle may name;
writers use it to encode the tensors a repair creates, without torch.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from optim_repair.errors import RepairRefused, shown


@dataclass(frozen=True)
class DType:
    """One torch dtype, by the name torch gives it without ``torch.``."""

    name: str
    itemsize: int
    struct_code: str = ""
    """The ``struct`` code of one element, where Python can encode it."""
    legacy_storage: str = ""
    """The typed storage class torch pickles name for it (``FloatStorage``), if any."""
    safetensors: str = ""
    """Its name in a safetensors header (``F32``), if any."""


_TABLE = (
    DType("float64", 8, "<d", "DoubleStorage", "F64"),
    DType("float32", 4, "<f", "FloatStorage", "F32"),
    DType("float16", 2, "<e", "HalfStorage", "F16"),
    DType("bfloat16", 2, "", "BFloat16Storage", "BF16"),
    DType("int64", 8, "<q", "LongStorage", "I64"),
    DType("int32", 4, "<i", "IntStorage", "I32"),
    DType("int16", 2, "<h", "ShortStorage", "I16"),
    DType("int8", 1, "<b", "CharStorage", "I8"),
    DType("uint8", 1, "<B", "ByteStorage", "U8"),
    DType("uint16", 2, "", "", "U16"),
    DType("uint32", 4, "", "", "U32"),
    DType("uint64", 8, "", "", "U64"),
    DType("bool", 1, "<?", "BoolStorage", "BOOL"),
    DType("complex128", 16, "", "ComplexDoubleStorage"),
    DType("complex64", 8, "", "ComplexFloatStorage", "C64"),
    DType("complex32", 4),
    DType("qint8", 1, "", "QInt8Storage"),
    DType("qint32", 4, "", "QInt32Storage"),
    DType("quint8", 1, "", "QUInt8Storage"),
    DType("quint4x2", 1, "", "QUInt4x2Storage"),
    DType("quint2x4", 1, "", "QUInt2x4Storage"),
    DType("float8_e4m3fn", 1, "", "", "F8_E4M3"),
    DType("float8_e4m3fnuz", 1),
    DType("float8_e5m2", 1, "", "", "F8_E5M2"),
    DType("float8_e5m2fnuz", 1),
    DType("float8_e8m0fnu", 1),
    DType("float4_e2m1fn_x2", 1),
    DType("bits8", 1),
    DType("bits16", 2),
    DType("bits1x8", 1),
    DType("bits2x4", 1),
    DType("bits4x2", 1),
)

DTYPES: Mapping[str, DType] = MappingProxyType({dtype.name: dtype for dtype in _TABLE})
"""Every torch dtype a checkpoint may name, by name; also the allowlist of ``torch.<dtype>`` globals."""

LEGACY_STORAGES: Mapping[str, str] = MappingProxyType(
    {dtype.legacy_storage: dtype.name for dtype in _TABLE if dtype.legacy_storage}
)
"""Typed storage classes a torch pickle names (``FloatStorage``), and the dtype each stands for."""

SAFETENSORS_NAMES: Mapping[str, str] = MappingProxyType(
    {dtype.safetensors: dtype.name for dtype in _TABLE if dtype.safetensors}
)
"""Dtype names of safetensors headers (``F32``), and the torch dtype each stands for."""


def is_floating(dtype: str) -> bool:
    """Whether ``dtype`` holds floating-point numbers, real or complex, as every tensor torch's optimizers keep
    does (``uint8`` does not: bitsandbytes' quantized state)."""
    return dtype.startswith(("float", "bfloat", "complex")) and dtype in DTYPES


def itemsize(dtype: str) -> int:
    """Bytes per element of ``dtype``; 1 for a name outside the table."""
    known = DTYPES.get(dtype)
    return known.itemsize if known else 1


def numel(shape: tuple[int, ...]) -> int:
    """How many elements a tensor of ``shape`` has."""
    count = 1
    for size in shape:
        count *= size
    return count


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides torch gives a contiguous tensor of ``shape`` (a size-0 dimension counts as 1)."""
    strides: list[int] = []
    running = 1
    for size in reversed(shape):
        strides.insert(0, running)
        running *= max(size, 1)
    return tuple(strides)


def _bfloat16(value: float) -> bytes:
    """Round a float to bfloat16 the way torch does (round to nearest, ties to even)."""
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    if (bits & 0x7F800000) == 0x7F800000 and bits & 0x007FFFFF:
        return struct.pack("<H", (bits >> 16) | 0x0040)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return struct.pack("<H", rounded & 0xFFFF)


def _real_part(value: float | int | bool | complex) -> float:
    return float(value.real if isinstance(value, complex) else value)


def _complex_code(dtype: str) -> str:
    return "<f" if dtype == "complex64" else "<d"


def element_bytes(dtype: str, value: float | int | bool | complex) -> bytes:
    """One little-endian element of ``dtype`` holding ``value``."""
    if dtype == "bfloat16":
        return _bfloat16(_real_part(value))
    if dtype in ("complex64", "complex128"):
        number = complex(value)
        return struct.pack(_complex_code(dtype), number.real) + struct.pack(_complex_code(dtype), number.imag)
    known = DTYPES.get(dtype)
    if known is None or not known.struct_code:
        raise RepairRefused(f"cannot create a {dtype} tensor holding {shown(value)}")
    if dtype.startswith("float"):
        return struct.pack(known.struct_code, _real_part(value))
    return struct.pack(known.struct_code, value)


CHUNK = 16 << 20
"""Bytes handled at a time, read, compared or created: large enough to stream at disk speed, small enough
to bound memory."""


def filled_chunks(
    dtype: str, shape: tuple[int, ...], fill: float | int | bool | complex, limit: int = CHUNK
) -> Iterator[bytes]:
    """The contiguous bytes of a ``dtype`` tensor of ``shape`` whose every element is ``fill``, in chunks of
    at most about ``limit`` bytes: a tensor of any size, in bounded memory."""
    element = bytes(itemsize(dtype)) if fill == 0 and dtype in DTYPES else element_bytes(dtype, fill)
    block = element * max(1, limit // len(element))
    remaining = numel(shape) * len(element)
    while remaining:
        size = min(len(block), remaining)
        yield block if size == len(block) else block[:size]
        remaining -= size


def decode_element(dtype: str, data: bytes) -> float | int | bool | complex | None:
    """The value of one element of ``dtype`` from its bytes; None for dtypes not decoded here."""
    if dtype == "bfloat16" and len(data) == 2:
        return float(struct.unpack("<f", b"\x00\x00" + data)[0])
    if dtype in ("complex64", "complex128"):
        half = len(data) // 2
        code = _complex_code(dtype)
        return complex(struct.unpack(code, data[:half])[0], struct.unpack(code, data[half:])[0])
    known = DTYPES.get(dtype)
    if known is None or not known.struct_code or struct.calcsize(known.struct_code) != len(data):
        return None
    value: float | int | bool = struct.unpack(known.struct_code, data)[0]
    return value
