"""Byte ranges read as files, one seek rule for all: a range of a file, files joined, an object of a store.

``RangeFile`` is their base: read-only, seekable as a file is. ``FileSlice`` reads a range of an open file (a DCP
entry, for ``zipfile``); ``Joined`` reads files end to end (a spliced torch file). The torch-file reader reads a
``RangedObject`` as it reads a local file: what it will need is fetched first, in few GETs (``prefetch``: the end
records and the central directory, the pickle); any other read is one GET.
"""

from __future__ import annotations

import bisect
import errno
import io
from collections.abc import Sequence
from typing import Any, BinaryIO

from optim_repair.storage.interface import Store
from optim_repair.storage.objects import StoredObject

READAHEAD = 8 << 10
"""What a read that nothing prefetched fetches beyond what it asks for."""


class RangeFile(io.RawIOBase):
    """A read-only file of ``_size`` bytes whose position seeks as a file's does: past its end freely, and never
    before its start (``EINVAL``, which ``zipfile`` takes for no zip archive, as it does from a file)."""

    _size = 0
    _position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise OSError(errno.EINVAL, "Invalid argument")
        self._position = base + offset
        return self._position


class FileSlice(RangeFile):
    """``length`` bytes of an open file from ``offset``, as a file of their own (a DCP entry, for ``zipfile``)."""

    def __init__(self, stream: BinaryIO, offset: int, length: int) -> None:
        super().__init__()
        self._stream, self._offset, self._size = stream, offset, length

    def readinto(self, buffer: Any) -> int:
        size = max(0, min(len(buffer), self._size - self._position))
        self._stream.seek(self._offset + self._position)
        data = self._stream.read(size)
        buffer[: len(data)] = data
        self._position += len(data)
        return len(data)


class Joined(RangeFile):
    """Files read as one, end to end: each part a readable, seekable file and the range of it that is joined (a
    spliced torch file: its new head, the original's kept bytes, its new tail). Closing it closes them."""

    def __init__(self, parts: Sequence[tuple[BinaryIO, int, int]]) -> None:
        super().__init__()
        self._parts, self._starts = [part for part in parts if part[2] > 0], []
        for _, _, length in self._parts:
            self._starts.append(self._size)
            self._size += length

    def close(self) -> None:
        for stream, _, _ in self._parts:
            stream.close()
        super().close()

    def readinto(self, buffer: Any) -> int:
        index = bisect.bisect_right(self._starts, self._position) - 1
        if self._position >= self._size or index < 0:
            return 0
        stream, start, length = self._parts[index]
        within = self._position - self._starts[index]
        stream.seek(start + within)
        data = stream.read(min(len(buffer), length - within))
        buffer[: len(data)] = data
        self._position += len(data)
        return len(data)


class RangedObject(RangeFile):
    """One object of a store as a read-only, seekable file: what was fetched (``prefetch``) is served from memory,
    and a read of anything else is one ranged GET of it and up to ``READAHEAD`` after it. Every GET names the
    listed ETag."""

    def __init__(
        self,
        store: Store,
        key: str,
        stored: StoredObject,
        spans: list[tuple[int, bytes]] | None = None,
        *,
        retain: bool = True,
    ) -> None:
        """``spans``: what was fetched of it already, shared with each object opened over the same list;
        ``retain=False``: only the last GET is kept (a read through every byte, in memory that does not grow)."""
        super().__init__()
        self._store, self._key, self._stored = store, key, stored
        self._spans = [] if spans is None else spans
        self._retain = retain
        self._size = stored.size

    @property
    def name(self) -> str:
        return self._store.where(self._key)

    def prefetch(self, wanted: Sequence[tuple[int, int]], *, gap: int) -> None:
        """Fetch the ranges ``wanted`` (clipped to the object) that are not fetched yet, those closer than ``gap``
        by one GET."""
        size = self._stored.size
        clipped = [(offset, min(length, size - offset)) for offset, length in wanted if 0 <= offset < size]
        missing = [
            (offset, length) for offset, length in clipped if length > 0 and self._cached(offset, length) is None
        ]
        for (offset, _), data in zip(
            missing, self._store.ranges(self._key, self._stored, missing, gap=gap), strict=True
        ):
            self._keep(offset, data)

    def _keep(self, offset: int, data: bytes) -> None:
        bisect.insort(self._spans, (offset, data), key=lambda span: span[0])

    def _cached(self, offset: int, length: int) -> memoryview | None:
        index = bisect.bisect_right(self._spans, offset, key=lambda span: span[0])
        for start, data in reversed(self._spans[:index]):  # those that start at or before offset, nearest first
            if offset + length <= start + len(data):
                return memoryview(data)[offset - start : offset - start + length]
        return None

    def readinto(self, buffer: Any) -> int:
        length = min(len(buffer), max(self._stored.size - self._position, 0))
        if length == 0:
            return 0
        found = self._cached(self._position, length)
        if found is None:
            end = min(self._stored.size, self._position + max(length, READAHEAD))
            if not self._retain:
                self._spans.clear()
            self._keep(self._position, self._store.get_range(self._key, self._stored, self._position, end))
            found = self._cached(self._position, length)
            assert found is not None
        buffer[:length] = found
        self._position += length
        return length
