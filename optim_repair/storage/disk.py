"""The local disk: input files opened as regular files only, never blocking; bytes moved by the kernel, compared.

A FIFO named ``optimizer.pt`` would block ``open()`` forever, and a link to ``/dev/zero`` would feed a
reader without end. Every reader opens its input here: ``stat`` must say a regular file, then it is
opened ``O_NONBLOCK`` and ``fstat`` of what was opened must say so too, so that a link is read through
only when it reaches one, whatever it was a moment before. Byte ranges are moved by the kernel where it can
(``kernel_copy``), and compared in bounded chunks (``same_range``).

What a reader parses it reads through the file, never through a mapping: a mapped file that another process cuts
short (``torch.save`` rewriting it in place, ``cp`` over it) ends the process with SIGBUS at the first page past
its new end. Read, the same file is a read that gives fewer bytes than its size said (``read_within``; a walk
over a large file reads it ahead into memory no file backs, ``ReadAhead``): exit 4, "changed while being read";
``check_same`` tells a file written to meanwhile by its size and modification time.
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from optim_repair.errors import InputError, os_error_reason
from optim_repair.records.dtypes import CHUNK
from optim_repair.storage.answers import CHANGED

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISLNK, "a symbolic link"),
)


def kind_of(mode: int) -> str:
    """What a file of ``mode`` is, in words (``a FIFO``); ``a regular file`` for one."""
    return next((kind for test, kind in _KINDS if test(mode)), "a regular file")


def open_regular(path: Path, source: str) -> BinaryIO:
    """Open ``path`` for reading, refusing anything but a regular file: a device is never opened (opening one
    can act), and what was opened is checked again, in case it changed in between."""
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            raise InputError(f"is {kind_of(mode)}, not a regular file", path=source)
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise InputError(f"cannot read ({os_error_reason(exc)})", path=source) from exc
    mode = os.fstat(descriptor).st_mode
    if not stat.S_ISREG(mode):
        os.close(descriptor)
        raise InputError(f"is {kind_of(mode)}, not a regular file", path=source)
    return os.fdopen(descriptor, "rb")


def size_of(stream: BinaryIO) -> int:
    """The size of an open regular file."""
    return os.fstat(stream.fileno()).st_size


Status = tuple[int, int]
"""An open file's size and modification time in nanoseconds: what tells that it was written to."""


def status_of(stream: BinaryIO) -> Status:
    found = os.fstat(stream.fileno())
    return found.st_size, found.st_mtime_ns


def check_same(stream: BinaryIO, before: Status, source: str) -> None:
    """Raise ``InputError`` (changed while being read) where the open file is no longer as ``before`` said: what
    was read of it may be of two versions."""
    if status_of(stream) != before:
        raise InputError(CHANGED, path=source)


def read_within(stream: BinaryIO, length: int, size: int, source: str) -> bytes:
    """Up to ``length`` bytes from the position of ``stream``, a file that held ``size`` bytes when it was opened:
    fewer only where it ended there. A file that gives fewer was cut short since: ``InputError`` (changed while
    being read)."""
    held = max(0, min(length, size - stream.tell()))
    data = stream.read(length)
    if len(data) < held:
        raise InputError(CHANGED, path=source)
    return data


def read_whole(stream: BinaryIO, source: str) -> bytes:
    """Every byte of an open file, which must not change while it is read (``check_same``)."""
    before = status_of(stream)
    data = read_within(stream, before[0], before[0], source)
    check_same(stream, before, source)
    return data


class ReadAhead:
    """A file read, as a walk over its bytes comes to them, into memory of its size that no file backs (an anonymous
    mapping, ``data``), whose pages behind the walk are let go: it holds at once what the walk reads ahead, and a
    file cut short meanwhile is a read that ends early (changed while being read), where a mapping of the file
    itself ended the process with SIGBUS."""

    def __init__(self, stream: BinaryIO, size: int, source: str) -> None:
        self.stream, self.size, self.source = stream, size, source
        self.data = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.read = 0

    def reach(self, end: int) -> int:
        """Read the file up to ``end`` (at most its size); return how far it is read."""
        end = min(end, self.size)
        if end > self.read:
            read = read_within(self.stream, end - self.read, self.size, self.source)
            self.data[self.read : self.read + len(read)] = read
            self.read += len(read)
        return self.read

    def release(self, end: int) -> None:
        """Let go of the pages before ``end`` (a multiple of the page size), which the walk has passed."""
        if hasattr(mmap, "MADV_DONTNEED"):
            self.data.madvise(mmap.MADV_DONTNEED, 0, end)


def open_beneath(directory: Path, relative: str, source: str) -> BinaryIO:
    """Open ``directory / relative`` (a path a file names, such as a DCP shard) without leaving
    ``directory`` through a link on the way; the file itself may be a link to a regular file (DVC)."""
    parts = PurePosixPath(relative).parts
    current = directory
    for part in parts[:-1]:
        current = current / part
        try:
            mode = os.lstat(current).st_mode
        except OSError as exc:
            raise InputError(f"cannot read ({os_error_reason(exc)})", path=source) from exc
        if not stat.S_ISDIR(mode):
            raise InputError(f"passes through {current.name}, which is {kind_of(mode)}", path=source)
    return open_regular(directory.joinpath(*parts), source)


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
