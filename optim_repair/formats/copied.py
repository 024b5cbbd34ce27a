"""The proof for files copied as they are: every byte compared from disk, and links kept as links."""

from __future__ import annotations

import os
from pathlib import Path

from optim_repair.errors import VerificationError
from optim_repair.records.verification import Verification
from optim_repair.storage.disk import open_regular, same_range


def same_file(original: Path, copy: Path) -> bool:
    """Whether ``copy`` is a regular file with the bytes of ``original`` (or the same file, hard-linked)."""
    if copy.is_symlink() or not copy.is_file():
        return False
    with open_regular(original, str(original)) as a, open_regular(copy, str(copy)) as b:
        first, second = os.fstat(a.fileno()), os.fstat(b.fileno())
        if (first.st_dev, first.st_ino) == (second.st_dev, second.st_ino):
            return True
        return first.st_size == second.st_size and same_range(a, 0, b, 0, first.st_size)


def verify_copied_file(original: Path, copy: Path, source: str) -> Verification:
    """Prove a file copied as-is is byte-identical."""
    if not same_file(original, copy):
        raise VerificationError("the copy differs from the original", path=source)
    return Verification(0, os.lstat(original).st_size)


def verify_copied_link(original: Path, copy: Path, source: str) -> None:
    """Prove a link kept as a link says what the original says (where it points, not what it reaches)."""
    if not copy.is_symlink() or os.readlink(copy) != os.readlink(original):
        raise VerificationError(f"is not the link {original} is", path=source)
