"""Opening input files: regular files only, never through a symbolic link, never blocking.

A FIFO named ``optimizer.pt`` would block ``open()`` forever, a link to ``/dev/zero`` would feed a
reader without end, and a link to a file outside the checkpoint would be read as part of it. Every
reader opens its input here: ``O_NOFOLLOW | O_NONBLOCK``, then ``fstat`` must say a regular file.
(The user's argument may itself be a link: ``discovery`` resolves it once, so that what is opened
here never is one.)
"""

from __future__ import annotations

import errno
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
    """Open ``path`` for reading, refusing anything but a regular file reached without a link."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
    try:
        descriptor = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise InputError("is a symbolic link; optim-repair reads no file through a link", path=source) from exc
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
    ``directory`` or passing through a link on the way."""
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
