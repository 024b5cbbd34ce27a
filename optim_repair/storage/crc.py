"""CRC-32 arithmetic: the checksum of bytes joined end to end, and of a middle part known only by the whole's.

A store keeps the CRC-32 of each whole object. An object composed of new bytes and a range of another object
inside the store is proven by the CRC-32 the composition must have: ``combine`` of its parts', where the
range's own CRC-32 (``middle``) follows from the original's and those of the bytes around the range, which
are read. This is zlib's ``crc32_combine``, and its inverse, in the reflected form zlib computes in.
"""

from __future__ import annotations

_POLY = 0xEDB88320
"""The CRC-32 polynomial, reflected."""
_ONE = 1 << 31
"""The polynomial 1, reflected."""
_X_INVERSE = 0xDB710641
"""x⁻¹ modulo the CRC-32 polynomial, reflected: multiplied by x, it gives 1."""


def _multiply(a: int, b: int) -> int:
    """a·b modulo the polynomial, both reflected (zlib's ``multmodp``)."""
    product, bit = 0, _ONE
    while a:
        if a & bit:
            product ^= b
            a ^= bit
        bit >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return product


def _power(base: int, exponent: int) -> int:
    result = _ONE
    while exponent:
        if exponent & 1:
            result = _multiply(result, base)
        base = _multiply(base, base)
        exponent >>= 1
    return result


def _shift(crc: int, length: int, *, back: bool = False) -> int:
    """``crc`` moved ``length`` bytes on (multiplied by x^(8·length)), or with ``back`` that far back."""
    return _multiply(_power(_X_INVERSE if back else _ONE >> 1, 8 * length), crc)


def combine(first: int, second: int, second_length: int) -> int:
    """The CRC-32 of A followed by B, from A's, B's and B's length."""
    return _shift(first, second_length) ^ second


def middle(whole: int, head: int, tail: int, middle_length: int, tail_length: int) -> int:
    """The CRC-32 of B, where A·B·C has CRC-32 ``whole``, A ``head`` and C ``tail``."""
    joined = _shift(whole ^ tail, tail_length, back=True)  # the CRC-32 of A·B
    return joined ^ _shift(head, middle_length)
