"""What a store says of an object.

Its size and version tag as listed, what a write gave back, a small object read whole, and CRC values as S3 and
GCS write them.
"""

from __future__ import annotations

import base64
import zlib
from dataclasses import dataclass
from pathlib import Path

_CHUNK = 8 << 20


@dataclass(frozen=True)
class StoredObject:
    """An object as a listing gave it."""

    size: int
    etag: str


@dataclass(frozen=True)
class Small:
    """A small object read whole (a marker): its bytes, its ETag, the run that wrote it (None when no run of
    optim-repair did), and how long ago it was last written, by the store's clock (None when it does not say)."""

    data: bytes
    etag: str
    run: str | None
    age: float | None


@dataclass(frozen=True)
class Copied:
    """What the store says of an object after writing it: the checksum it keeps of the whole object (its
    ``WritableStore.proof``: S3's CRC-32, GCS's CRC-32C; None when it computed none) and its version tag."""

    checksum: str | None
    etag: str


def crc32_of(path: Path) -> str:
    """A file's CRC32, as S3 writes it (base64 of the big-endian value)."""
    value = 0
    with path.open("rb") as stream:
        while chunk := stream.read(_CHUNK):
            value = zlib.crc32(chunk, value)
    return encoded_crc32(value)


def encoded_crc32(value: int) -> str:
    """A CRC as S3 writes a CRC-32 and GCS a CRC-32C (base64 of the big-endian value)."""
    return base64.b64encode(value.to_bytes(4, "big")).decode()


@dataclass(frozen=True)
class Composed:
    """What the store says of an object composed of new bytes and a copied range (its checksum, None without one,
    and its version tag), and the checksum it must have (None where the original has none to derive it from)."""

    written: Copied
    expected: str | None
