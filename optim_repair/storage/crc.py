"""CRC arithmetic: the checksum of bytes joined end to end, and of a middle part known only by the whole's.

A store keeps a CRC of each whole object: S3 a CRC-32, GCS a CRC-32C. An object composed of new bytes and a range
of another object inside the store is proven by the CRC the composition must have: ``combine`` of its parts',
where the range's own CRC (``middle``) follows from the original's and those of the bytes around the range,
which are read. This is zlib's ``crc32_combine``, and its inverse, in the reflected form zlib computes in, for
either polynomial (``CRC32``, ``CRC32C``).
"""

from __future__ import annotations

from dataclasses import dataclass

_ONE = 1 << 31
"""The polynomial 1, reflected."""


@dataclass(frozen=True)
class Polynomial:
    """A CRC's polynomial, reflected, and x⁻¹ modulo it (multiplied by x, it gives 1)."""

    reflected: int
    x_inverse: int


CRC32 = Polynomial(0xEDB88320, 0xDB710641)
"""zlib's CRC-32, which S3 keeps."""
CRC32C = Polynomial(0x82F63B78, 0x05EC76F1)
"""Castagnoli's CRC-32C, which GCS keeps."""


def _multiply(a: int, b: int, poly: Polynomial) -> int:
    """a·b modulo the polynomial, both reflected (zlib's ``multmodp``)."""
    product, bit = 0, _ONE
    while a:
        if a & bit:
            product ^= b
            a ^= bit
        bit >>= 1
        b = (b >> 1) ^ poly.reflected if b & 1 else b >> 1
    return product


def _power(base: int, exponent: int, poly: Polynomial) -> int:
    result = _ONE
    while exponent:
        if exponent & 1:
            result = _multiply(result, base, poly)
        base = _multiply(base, base, poly)
        exponent >>= 1
    return result


def _shift(crc: int, length: int, poly: Polynomial, *, back: bool = False) -> int:
    """``crc`` moved ``length`` bytes on (multiplied by x^(8·length)), or with ``back`` that far back."""
    return _multiply(_power(poly.x_inverse if back else _ONE >> 1, 8 * length, poly), crc, poly)


def combine(first: int, second: int, second_length: int, poly: Polynomial = CRC32) -> int:
    """The CRC of A followed by B, from A's, B's and B's length."""
    return _shift(first, second_length, poly) ^ second


def middle(whole: int, head: int, tail: int, middle_length: int, tail_length: int, poly: Polynomial = CRC32) -> int:
    """The CRC of B, where A·B·C has CRC ``whole``, A ``head`` and C ``tail``."""
    joined = _shift(whole ^ tail, tail_length, poly, back=True)  # the CRC of A·B
    return joined ^ _shift(head, middle_length, poly)
