"""Byte ranges moved by the kernel: a file that ends while it is being copied is named in the refusal."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from optim_repair.errors import InputError
from optim_repair.storage.disk import kernel_copy


@pytest.mark.parametrize("offset", [0, 4096])
def test_a_file_truncated_while_being_copied_is_named(tmp_path: Path, offset: int) -> None:
    """The file is truncated after its size was taken: the copy finds its end early and names it."""
    source, target = tmp_path / "shard.distcp", tmp_path / "copy"
    source.write_bytes(os.urandom(8192))
    with source.open("rb") as original, target.open("wb") as copy:
        size = os.fstat(original.fileno()).st_size
        os.truncate(source, offset + 100)
        with pytest.raises(InputError) as refused:
            kernel_copy(original.fileno(), copy.fileno(), offset, size - offset, 0, name=str(source))
    assert refused.value.path == str(source)
    assert str(refused.value).startswith(f"{source}: ended while being copied: something truncated it meanwhile")
