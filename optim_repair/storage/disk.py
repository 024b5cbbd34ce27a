"""The local disk: input files opened as regular files only, never blocking; bytes moved by the kernel, compared.

A FIFO named ``optimizer.pt`` would block ``open()`` forever, and a link to ``/dev/zero`` would feed a
reader without end. Every reader opens its input here: ``stat`` must say a regular file, then it is
opened ``O_NONBLOCK`` and ``fstat`` of what was opened must say so too, so that a link is read through
only when it reaches one, whatever it was a moment before. Byte ranges are moved by the kernel where it can
(``kernel_copy``), and compared in bounded chunks (``same_range``).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from optim_repair.errors import InputError, os_error_reason
from optim_repair.records.dtypes import CHUNK

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
