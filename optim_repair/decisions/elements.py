"""Comparing two tensors' elements block by block: how many differ in their bits, and by how much at most.

Equal stretches are passed over at ``memcmp`` speed; only a stretch that differs is decoded, element by element,
where Python can decode the dtype (the float formats, bfloat16, fp8, integers, bool, complex). Pure functions.
"""

from __future__ import annotations

import math
import operator
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Literal

from optim_repair.records.dtypes import DTYPES, itemsize

STRETCH = 64 << 10
"""Bytes compared as one stretch before a differing block is decoded: a flipped bit decodes this much."""
_WORDS: dict[int, Literal["B", "H", "I", "Q"]] = {1: "B", 2: "H", 4: "I", 8: "Q"}
_CODES = {"float64": "d", "float32": "f", "float16": "e"}

Number = float | int | complex


def _fp8_table(exponent_bits: int, bias: int, *, infinities: bool) -> tuple[float, ...]:
    """The value of each of the 256 bytes of an fp8 format with a sign, ``exponent_bits`` and the rest mantissa:
    IEEE-like with infinities (e5m2), or without, the all-ones pattern alone NaN (e4m3fn)."""
    mantissa_bits = 7 - exponent_bits
    top = (1 << exponent_bits) - 1
    values = []
    for byte in range(256):
        sign = -1.0 if byte & 0x80 else 1.0
        exponent, mantissa = (byte >> mantissa_bits) & top, byte & ((1 << mantissa_bits) - 1)
        if exponent == top and (infinities or mantissa == (1 << mantissa_bits) - 1):
            values.append(sign * math.inf if infinities and mantissa == 0 else math.nan)
        elif exponent == 0:
            values.append(sign * mantissa * 2.0 ** (1 - bias - mantissa_bits))
        else:
            values.append(sign * (1 + mantissa / (1 << mantissa_bits)) * 2.0 ** (exponent - bias))
    return tuple(values)


@cache
def _fp8(dtype: str) -> tuple[float, ...]:
    return _fp8_table(4, 7, infinities=False) if dtype == "float8_e4m3fn" else _fp8_table(5, 15, infinities=True)


def _bfloat16(data: bytes) -> tuple[float, ...]:
    widened = bytearray(2 * len(data))  # each element's two bytes become a float32's high half
    widened[2::4], widened[3::4] = data[0::2], data[1::2]
    return struct.unpack(f"<{len(data) // 2}f", widened)


def decoder(dtype: str) -> Callable[[bytes], Sequence[Number]] | None:
    """What decodes a block of ``dtype`` elements into numbers, or None where Python cannot."""
    if dtype in _CODES:
        return lambda data: struct.unpack(f"<{len(data) // itemsize(dtype)}{_CODES[dtype]}", data)
    if dtype == "bfloat16":
        return _bfloat16
    if dtype in ("float8_e4m3fn", "float8_e5m2"):
        table = _fp8(dtype)
        return lambda data: [table[byte] for byte in data]
    if dtype in ("complex64", "complex128"):
        code = "f" if dtype == "complex64" else "d"

        def complexes(data: bytes) -> list[complex]:
            parts = struct.unpack(f"<{len(data) // struct.calcsize(code)}{code}", data)
            return [complex(real, imag) for real, imag in zip(parts[0::2], parts[1::2], strict=True)]

        return complexes
    known = DTYPES.get(dtype)
    if known is not None and known.struct_code:
        code = known.struct_code[-1]
        return lambda data: struct.unpack(f"<{len(data) // known.itemsize}{code}", data)
    return None


@dataclass
class ElementTally:
    """What differs between two tensors of one dtype, as their blocks are added."""

    dtype: str
    differing: int = 0
    largest: float | None = None
    """The largest absolute difference of two numbers that differ (None: none, or not decoded)."""
    non_finite: bool = False
    """Whether a differing element is NaN or infinite on one side (its difference is none)."""

    def add(self, a: bytes, b: bytes, times: int = 1) -> None:
        """Add two blocks of equal length, each of whole elements, each element standing for ``times`` of the
        tensor's (a tensor expanded along a dimension holds each stored element that many times)."""
        if a == b:
            return
        for start in range(0, len(a), STRETCH):
            stretch_a, stretch_b = a[start : start + STRETCH], b[start : start + STRETCH]
            if stretch_a != stretch_b:  # bytes compare by memcmp (memoryviews, element by element)
                self._differing(stretch_a, stretch_b, times)

    def _differing(self, a: bytes, b: bytes, times: int) -> None:
        size = itemsize(self.dtype)
        if size in _WORDS:
            words_a, words_b = memoryview(a).cast(_WORDS[size]), memoryview(b).cast(_WORDS[size])
            changed = [index for index, differs in enumerate(map(operator.ne, words_a, words_b)) if differs]
        else:
            changed = [
                i for i in range(0, len(a) // size) if a[i * size : (i + 1) * size] != b[i * size : (i + 1) * size]
            ]
        self.differing += len(changed) * times
        decode = decoder(self.dtype)
        if decode is None:
            return
        numbers_a, numbers_b = decode(a), decode(b)
        for index in changed:
            difference = abs(numbers_a[index] - numbers_b[index])
            if not math.isfinite(difference):
                self.non_finite = True
            elif self.largest is None or difference > self.largest:
                self.largest = float(difference)
