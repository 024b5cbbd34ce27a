"""The records torch's pickler writes for each chunk of a DCP ``.metadata``: recognised whole, and summed in runs.

A chunk is a ``ChunkStorageMetadata`` (its offsets and sizes, two ``torch.Size``), and its storage entry a
``MetadataIndex`` and ``_StorageInfo`` pair: each pickled in the same few dozen bytes, with its class and field
names fetched from the memo. The patterns here match exactly those bytes, built from the fetches of the memo
entries that hold the names (``metadata_summary`` knows which), and a ``ChunkRun`` or ``StorageRun`` holds
what consecutive records sum to. A ``Summary`` is what a walk leaves: the pickle that remains, and its runs.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field
from functools import cache
from pathlib import PurePosixPath

from optim_repair.errors import shown

_CHECKPOINT = "torch.distributed.checkpoint.metadata"
CLASSES = {
    "chunk": (_CHECKPOINT, "ChunkStorageMetadata"),
    "index": (_CHECKPOINT, "MetadataIndex"),
    "info": ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    "size": ("torch", "Size"),
}
MAX_NDIM = 3
"""The dimensions a summarized chunk may have (torch's pickler writes TUPLE1 to TUPLE3 for them)."""
CHUNK_MEMO = 8
"""Memo entries a chunk record makes: the object, its state, and three for each ``torch.Size``."""
PAIR_MEMO = 7
"""Memo entries a storage pair makes (with a memoized ``fqn`` string of its own: one more)."""


@dataclass(eq=False)
class ChunkRun:
    """Consecutive chunks of one tensor, of ``ndim`` dimensions each, summarized."""

    ndim: int
    count: int
    held: int
    """How many elements the chunks hold together."""
    ends: list[int]
    """For each dimension, the furthest a chunk reaches in it (offset plus size)."""

    def outside(self, size: tuple[int, ...]) -> bool:
        """Whether a chunk does not lie inside a tensor of ``size`` (offsets and sizes are never negative here: the
        walk leaves a record with a negative one to be read whole)."""
        return len(size) != self.ndim or any(end > whole for end, whole in zip(self.ends, size, strict=True))


@dataclass(eq=False)
class ShardEnds:
    """What every storage run of one walk reaches: for each shard, the furthest byte of an entry, and its key
    (one table for all of them, so that it grows with shards, not with runs)."""

    runs: int = 0
    ends: dict[str, tuple[int, str]] = field(default_factory=dict)


@dataclass(eq=False)
class StorageRun:
    """Consecutive storage entries of tensor chunks, summarized."""

    shards: ShardEnds
    count: int = 0
    keys: set[str] = field(default_factory=set)


MODULE = "optim_repair.summarized"
"""The module of the stand-in global that takes a run's place in the summarized pickle."""


class NotSummarized(Exception):
    """The pickle is not one ``summarize`` follows exactly: read it whole."""


@dataclass(frozen=True)
class Summary:
    """A ``.metadata`` summarized: the pickle that remains, and the runs its stand-ins name."""

    data: bytes
    name: str
    """The stand-in global's name (``MODULE.name``), drawn afresh for each walk so no file can name it."""
    chunks: list[ChunkRun]
    storage: list[StorageRun]

    def stand_in(self, kind: int, index: int) -> ChunkRun | StorageRun:
        """The run a stand-in names: ``REDUCE`` of the global with ``(kind, index)``."""
        return self.chunks[index] if kind == 0 else self.storage[index]


@dataclass(frozen=True)
class Global:
    module: str
    name: str


_INT = rb"(K.|M..|J....)"
_ANY_INT = rb"(?:K.|M..|J....)"
_GET = rb"(h.|j....)"
_SIGNED4 = struct.Struct("<i").unpack_from


SMALL_INTS = {b"K" + bytes([value]): value for value in range(256)}
"""Every BININT1, by its encoding."""


def int_value(encoded: bytes) -> int:
    """A BININT1, BININT2 or BININT argument."""
    if encoded[0] == 0x4B:
        return encoded[1]
    if encoded[0] == 0x4D:
        return encoded[1] | encoded[2] << 8
    return int(_SIGNED4(encoded, 1)[0])


def fetch(index: int) -> bytes:
    """The opcode torch's pickler writes to fetch memo entry ``index``."""
    return b"h" + bytes([index]) if index < 256 else b"j" + struct.pack("<I", index)


def _record(get_class: bytes) -> bytes:
    """An object of a memoized class made by ``NEWOBJ``, and its state dict opened: ``BUILD`` follows its items."""
    return re.escape(get_class) + rb"\)\x81\x94}\x94\("


def _size(get_size: bytes, ndim: int, integer: bytes = _INT) -> bytes:
    """A ``torch.Size`` of ``ndim`` small integers, as ``REDUCE`` of the class with one tuple."""
    return re.escape(get_size) + integer * ndim + bytes([0x84 + ndim]) + rb"\x94\x85\x94R\x94"


@cache
def chunk_pattern(gets: tuple[bytes, ...], ndim: int) -> re.Pattern[bytes]:
    chunk, size, offsets, sizes = gets
    escaped = [re.escape(get) for get in (offsets, sizes)]
    body = _record(chunk) + escaped[0] + _size(size, ndim) + escaped[1] + _size(size, ndim) + b"ub"
    return re.compile(body, re.DOTALL)


@cache
def pair_pattern(gets: tuple[bytes, ...], ndim: int, written: int | None) -> re.Pattern[bytes]:
    """A ``MetadataIndex`` (``fqn``, ``index``, ``offset`` of ``ndim`` dimensions) and its ``_StorageInfo``, whose
    ``fqn`` is fetched from the memo (``written`` None) or is a string of ``written`` bytes written there. The
    groups: the fetch or the string; the fetch of the shard's name, the offset and the length."""
    index_class, fqn, size, info_class, index, offset, relative_path, length = gets
    escaped = [re.escape(get) for get in (fqn, index, offset, relative_path, length)]
    named = _GET if written is None else b"\x8c" + re.escape(bytes([written])) + b"(.{%d})\x94" % written
    body = (
        _record(index_class) + escaped[0] + named
        + escaped[1] + rb"(?:" + _ANY_INT + rb"|N)" + escaped[2] + _size(size, ndim, _ANY_INT) + b"ub"
        + _record(info_class) + escaped[3] + _GET + escaped[2] + _INT + escaped[4] + _INT + b"ub"
    )  # fmt: skip
    return re.compile(body, re.DOTALL)


def path_fault(value: object) -> str | None:
    """What is wrong with a storage entry's shard name, as its refusal says it; None for a name inside the
    checkpoint directory (the one judge of both reads: the walk reads a record naming any other whole)."""
    if not isinstance(value, str) or not value:
        return f"a storage entry names the file {shown(value)}"
    if "\x00" in value:
        return f"a storage entry names the file {shown(value)}, which holds a NUL byte"
    pure = PurePosixPath(value)
    if pure.is_absolute() or ".." in pure.parts or "\\" in value:
        return f"a storage entry points outside the checkpoint directory ({shown(value)})"
    return None
