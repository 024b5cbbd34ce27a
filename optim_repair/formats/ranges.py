"""Byte ranges of open files: moved, compared, or read as files of their own.

Moved by the kernel where it can, compared in bounded chunks; ``FileSlice`` and ``Joined`` read ranges as files.
"""

from __future__ import annotations

import bisect
import errno
import io
import os
from collections.abc import Sequence
from typing import Any, BinaryIO

from optim_repair.errors import InputError
from optim_repair.records.dtypes import CHUNK


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


_ENDED = "ended while being copied: something truncated it meanwhile; run again once nothing writes to it"


def kernel_copy(source: int, target: int, offset: int, length: int, target_offset: int, *, name: str) -> None:
    """Copy ``length`` bytes of the descriptor ``source`` (the file ``name``, for messages) from ``offset`` to
    ``target`` at ``target_offset``.

    ``copy_file_range`` first: the kernel moves the bytes (a reflink on btrfs and XFS, a server-side
    copy on NFS 4.2), never through Python; ``pread``/``pwrite`` in chunks where it is not available.
    """
    done = 0
    while done < length:
        try:
            moved = os.copy_file_range(source, target, length - done, offset + done, target_offset + done)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF):
                raise
            moved = -1
        if moved == 0:
            raise InputError(_ENDED, path=name)
        if moved < 0:
            break
        done += moved
    while done < length:
        chunk = os.pread(source, min(CHUNK, length - done), offset + done)
        if not chunk:
            raise InputError(_ENDED, path=name)
        write_all(target, chunk, target_offset + done)
        done += len(chunk)


def write_all(target: int, data: bytes | memoryview, offset: int) -> None:
    """``pwrite`` all of ``data`` at ``offset`` (a write may be short)."""
    view = memoryview(data)
    while view:
        written = os.pwrite(target, view, offset)
        view, offset = view[written:], offset + written


class _Seekable(io.RawIOBase):
    """A read-only file of ``_size`` bytes whose position seeks as a file's does, never before its start."""

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
        self._position = max(0, base + offset)
        return self._position


class FileSlice(_Seekable):
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


class Joined(_Seekable):
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
