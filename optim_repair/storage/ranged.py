"""An object of a store read as a file: seekable, fetched by ranges, what was fetched kept in memory.

The torch-file reader reads a ``RangedObject`` as it reads a local file. What it will need is fetched first, in few
GETs (``prefetch``: the end records and the central directory, the pickle); any other read is one GET.
"""

from __future__ import annotations

import bisect
import errno
import io
from collections.abc import Sequence
from typing import Any

from optim_repair.storage.interface import Store
from optim_repair.storage.objects import StoredObject

READAHEAD = 8 << 10
"""What a read that nothing prefetched fetches beyond what it asks for."""


class RangedObject(io.RawIOBase):
    """One object of a store as a read-only, seekable file: what was fetched (``prefetch``) is served from memory,
    and a read of anything else is one ranged GET of it and up to ``READAHEAD`` after it. Every GET names the
    listed ETag."""

    def __init__(
        self, store: Store, key: str, stored: StoredObject, spans: list[tuple[int, bytes]] | None = None
    ) -> None:
        """``spans``: what was fetched of it already, shared with each object opened over the same list."""
        super().__init__()
        self._store, self._key, self._stored = store, key, stored
        self._spans = [] if spans is None else spans
        self._position = 0

    @property
    def name(self) -> str:
        return self._store.where(self._key)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._stored.size}[whence]
        if base + offset < 0:  # as a file answers it: zipfile takes that for no zip archive
            raise OSError(errno.EINVAL, "Invalid argument")
        self._position = base + offset
        return self._position

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
            self._keep(self._position, self._store.get_range(self._key, self._stored, self._position, end))
            found = self._cached(self._position, length)
            assert found is not None
        buffer[:length] = found
        self._position += length
        return length
