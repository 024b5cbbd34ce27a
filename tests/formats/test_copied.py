"""Verification of files copied as they are (``optim_repair.formats.copied``): every byte compared."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from optim_repair.errors import VerificationError
from optim_repair.formats.copied import verify_copied_file


def test_copied_files_are_compared_byte_for_byte(tmp_path: Path) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_bytes(b'{"x": 1}\n')
    shutil.copyfile(a, b)
    assert verify_copied_file(a, b, "a.json").bytes == 9
    b.write_bytes(b'{"x": 2}\n')
    with pytest.raises(VerificationError, match=r"a\.json: the copy differs"):
        verify_copied_file(a, b, "a.json")
    b.write_bytes(b'{"x": 1}\n\n')
    with pytest.raises(VerificationError):
        verify_copied_file(a, b, "a.json")
