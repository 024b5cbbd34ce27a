"""Comparing two tensors' elements block by block: how many differ in their bits, and by how much at most.

Equal stretches are passed over at ``memcmp`` speed. In a stretch that differs, the elements that differ are
counted on their bits (the exclusive or of the two stretches as integers, folded onto each element's lowest bit),
and the stretch is decoded only for its largest difference, where Python can decode the dtype (the float formats,
bfloat16, fp8, integers, bool, complex): C loops over the numbers, no Python code run per element. Pure functions.
"""

from __future__ import annotations

import cmath
import itertools
import math
import operator
import struct
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import Literal

from optim_repair.records.dtypes import DTYPES, itemsize

STRETCH = 256 << 10
"""Bytes compared as one stretch before a differing one is counted and decoded (its numbers are held at once, a
few MiB): a flipped bit decodes this much."""
_WORDS: dict[int, Literal["B", "H", "I", "Q"]] = {1: "B", 2: "H", 4: "I", 8: "Q"}

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


def _floats(code: Literal["f", "d"]) -> Callable[[bytes | bytearray], Sequence[float]]:
    """What reads a block as little-endian float32 (``f``) or float64 (``d``) numbers: in place where this
    machine is little-endian too."""
    if sys.byteorder == "little":
        return lambda data: memoryview(data).cast(code)
    return lambda data: struct.unpack(f"<{len(data) // struct.calcsize(code)}{code}", data)


_FLOAT32, _FLOAT64 = _floats("f"), _floats("d")


def _bfloat16(data: bytes) -> Sequence[float]:
    widened = bytearray(2 * len(data))  # each element's two bytes become a float32's high half
    widened[2::4], widened[3::4] = data[0::2], data[1::2]
    return _FLOAT32(widened)


def decoder(dtype: str) -> Callable[[bytes], Sequence[Number]] | None:
    """What decodes a block of ``dtype`` elements into numbers, or None where Python cannot."""
    if dtype in ("float32", "float64"):
        return _FLOAT32 if dtype == "float32" else _FLOAT64
    if dtype == "bfloat16":
        return _bfloat16
    if dtype in ("float8_e4m3fn", "float8_e5m2"):
        table = _fp8(dtype)
        return lambda data: list(map(table.__getitem__, data))
    if dtype in ("complex64", "complex128"):
        parts = _FLOAT32 if dtype == "complex64" else _FLOAT64

        def complexes(data: bytes) -> list[complex]:
            halves = parts(data)
            return list(map(complex, halves[0::2], halves[1::2]))

        return complexes
    known = DTYPES.get(dtype)
    if known is not None and known.struct_code:
        code = known.struct_code[-1]
        return lambda data: struct.unpack(f"<{len(data) // known.itemsize}{code}", data)
    return None


_TOP = {"float64": (8, 0x7F), "float32": (4, 0x7F), "float16": (2, 0x7C), "bfloat16": (2, 0x7F),
        "complex128": (8, 0x7F), "complex64": (4, 0x7F),
        "float8_e4m3fn": (1, 0x7F), "float8_e5m2": (1, 0x7C)}  # fmt: skip
"""Per floating dtype: the bytes of each of its floats, and the exponent's bits in its highest byte: a float
whose bits there are all set may be NaN or infinite (or one of the largest finite)."""


@cache
def _all_set(mask: int) -> bytes:
    return bytes(int(byte & mask == mask) for byte in range(256))


def may_be_non_finite(dtype: str, data: bytes) -> bool:
    """Whether a block of ``dtype`` elements may hold a NaN or an infinity: some float's highest byte has every
    exponent bit set there (read a byte a float, by ``memchr``)."""
    if dtype not in _TOP:
        return False
    size, mask = _TOP[dtype]
    return b"\x01" in data[size - 1 :: size].translate(_all_set(mask))


@lru_cache(maxsize=4)
def _lowest_bits(length: int, size: int) -> int:
    """An integer of ``length`` bytes, little-endian, whose only bits set are the lowest of each ``size`` bytes."""
    return int.from_bytes((b"\x01" + bytes(size - 1)) * (length // size), "little")


def differing_elements(a: bytes, b: bytes, size: int) -> int:
    """How many of the ``size``-byte elements (1, 2, 4, 8 or 16 bytes) of two stretches differ in their bits."""
    folded = int.from_bytes(a, "little") ^ int.from_bytes(b, "little")
    shift = size * 4
    while shift:  # every bit of an element is ORed onto its lowest, none of another element's
        folded |= folded >> shift
        shift //= 2
    return (folded & _lowest_bits(len(a), size)).bit_count()


def _changed(a: bytes, b: bytes, size: int) -> Iterator[bool]:
    """Whether each ``size``-byte element of two stretches differs in its bits."""
    if size in _WORDS:
        return map(operator.ne, memoryview(a).cast(_WORDS[size]), memoryview(b).cast(_WORDS[size]))
    halves_a, halves_b = memoryview(a).cast("Q"), memoryview(b).cast("Q")
    return map(
        operator.or_, map(operator.ne, halves_a[0::2], halves_b[0::2]), map(operator.ne, halves_a[1::2], halves_b[1::2])
    )


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
            if stretch_a != stretch_b:  # bytes compare by memcmp
                self._differing(stretch_a, stretch_b, times)

    def _differing(self, a: bytes, b: bytes, times: int) -> None:
        size = itemsize(self.dtype)
        self.differing += differing_elements(a, b, size) * times
        decode = decoder(self.dtype)
        if decode is None:
            return
        numbers_a, numbers_b = decode(a), decode(b)
        if not (may_be_non_finite(self.dtype, a) or may_be_non_finite(self.dtype, b)):
            largest = max(map(abs, map(operator.sub, numbers_a, numbers_b)))  # 0 where they are the same
            if cmath.isfinite(largest):
                self._larger(largest)
                return
        # A NaN or an infinity on a side, or a difference past the largest float: only the elements that differ
        # count, and of those only the finite differences for the largest.
        differences = list(itertools.compress(map(abs, map(operator.sub, numbers_a, numbers_b)), _changed(a, b, size)))
        self.non_finite = self.non_finite or not all(map(cmath.isfinite, differences))
        finite = list(filter(cmath.isfinite, differences))
        if finite:
            self._larger(max(finite))

    def _larger(self, difference: float) -> None:
        if self.largest is None or difference > self.largest:
            self.largest = float(difference)
