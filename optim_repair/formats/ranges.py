"""Byte ranges of open files, moved or compared in bounded chunks: the one chunked loop of each kind."""

from __future__ import annotations

from typing import BinaryIO

from optim_repair.errors import InputError

CHUNK = 16 << 20
"""Bytes read at a time: large enough to stream at disk speed, small enough to bound memory."""


def copy_range(source: BinaryIO, target: BinaryIO, offset: int, length: int) -> None:
    """Append ``length`` bytes of ``source`` from ``offset`` to ``target``."""
    source.seek(offset)
    remaining = length
    while remaining:
        chunk = source.read(min(CHUNK, remaining))
        if not chunk:
            raise InputError("ended while being copied", path=str(getattr(source, "name", "the input")))
        target.write(chunk)
        remaining -= len(chunk)


def same_range(a: BinaryIO, a_offset: int, b: BinaryIO, b_offset: int, length: int) -> bool:
    """Whether ``length`` bytes of ``a`` from ``a_offset`` equal those of ``b`` from ``b_offset``."""
    a.seek(a_offset)
    b.seek(b_offset)
    remaining = length
    while remaining:
        size = min(CHUNK, remaining)
        left, right = a.read(size), b.read(size)
        if left != right or len(left) != size:
            return False
        remaining -= size
    return True
