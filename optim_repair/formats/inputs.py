"""Opening input files: regular files only, never blocking.

A FIFO named ``optimizer.pt`` would block ``open()`` forever, and a link to ``/dev/zero`` would feed a
reader without end. Every reader opens its input here: ``stat`` must say a regular file, then it is
opened ``O_NONBLOCK`` and ``fstat`` of what was opened must say so too, so that a link is read through
only when it reaches one, whatever it was a moment before.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from optim_repair.errors import InputError, os_error_reason

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
