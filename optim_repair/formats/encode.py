"""Raw little-endian bytes of the tensors a repair creates, without torch."""

from __future__ import annotations

import struct

from optim_repair.errors import RepairRefused
from optim_repair.fresh import FreshTensor
from optim_repair.inventory import ELEMENT_SIZES

_STRUCT_CODES = {
    "float64": "<d",
    "float32": "<f",
    "float16": "<e",
    "int64": "<q",
    "int32": "<i",
    "int16": "<h",
    "int8": "<b",
    "uint8": "<B",
    "bool": "<?",
}


def _bfloat16(value: float) -> bytes:
    """Round a float to bfloat16 the way torch does (round to nearest, ties to even)."""
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    if (bits & 0x7F800000) == 0x7F800000 and bits & 0x007FFFFF:
        return struct.pack("<H", (bits >> 16) | 0x0040)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return struct.pack("<H", rounded & 0xFFFF)


def element_bytes(dtype: str, value: float | int | bool | complex) -> bytes:
    """One element of ``dtype`` holding ``value``."""
    if dtype == "bfloat16":
        return _bfloat16(float(value.real if isinstance(value, complex) else value))
    if dtype in ("complex64", "complex128"):
        code = "<f" if dtype == "complex64" else "<d"
        number = complex(value)
        return struct.pack(code, number.real) + struct.pack(code, number.imag)
    struct_code = _STRUCT_CODES.get(dtype)
    if struct_code is None:
        raise RepairRefused(f"cannot create a {dtype} tensor holding {value!r}")
    if dtype.startswith("float"):
        return struct.pack(struct_code, float(value.real if isinstance(value, complex) else value))
    return struct.pack(struct_code, value)


def tensor_bytes(tensor: FreshTensor) -> bytes:
    """The contiguous bytes of ``tensor``: every element equal to its fill."""
    numel = 1
    for size in tensor.shape:
        numel *= size
    if tensor.fill == 0 and tensor.dtype in ELEMENT_SIZES:
        return bytes(numel * ELEMENT_SIZES[tensor.dtype])
    return element_bytes(tensor.dtype, tensor.fill) * numel


def decode_element(dtype: str, data: bytes) -> float | int | bool | complex | None:
    """The value of one element of ``dtype`` from its bytes; None for dtypes not decoded here."""
    if dtype == "bfloat16" and len(data) == 2:
        return float(struct.unpack("<f", b"\x00\x00" + data)[0])
    if dtype in ("complex64", "complex128"):
        code = "<f" if dtype == "complex64" else "<d"
        half = len(data) // 2
        return complex(struct.unpack(code, data[:half])[0], struct.unpack(code, data[half:])[0])
    struct_code = _STRUCT_CODES.get(dtype)
    if struct_code is None or struct.calcsize(struct_code) != len(data):
        return None
    value: float | int | bool = struct.unpack(struct_code, data)[0]
    return value
