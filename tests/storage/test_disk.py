"""Byte ranges moved by the kernel: a file that ends while it is being copied is named in the refusal; a file read
through that another process cuts short or writes to meanwhile is "changed while being read"."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from optim_repair.errors import InputError
from optim_repair.storage.answers import CHANGED
from optim_repair.storage.disk import check_same, kernel_copy, open_regular, read_within, status_of


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


def _cut(path: Path, size: int) -> None:
    """Cut ``path`` to ``size`` bytes from another process, as ``torch.save`` rewriting it in place would."""
    subprocess.run(["truncate", "-s", str(size), str(path)], check=True)


def test_a_file_cut_short_after_its_size_was_taken_is_changed_while_read(tmp_path: Path) -> None:
    path = tmp_path / "legacy.pt"
    path.write_bytes(os.urandom(1 << 20))
    with open_regular(path, "legacy.pt") as stream:
        size = status_of(stream)[0]
        assert read_within(stream, 4096, size, "legacy.pt") == path.read_bytes()[:4096]
        _cut(path, 8192)
        assert len(read_within(stream, 4096, size, "legacy.pt")) == 4096  # what it still holds reads as before
        with pytest.raises(InputError) as refused:
            read_within(stream, 4096, size, "legacy.pt")
    assert (refused.value.reason, refused.value.path) == (CHANGED, "legacy.pt")
    with open_regular(path, "legacy.pt") as stream:  # a file that ends where its size said is no change
        assert len(read_within(stream, 1 << 20, status_of(stream)[0], "legacy.pt")) == 8192


def test_a_file_written_to_while_it_was_read_is_changed_while_read(tmp_path: Path) -> None:
    path = tmp_path / ".metadata"
    path.write_bytes(bytes(4096))
    with open_regular(path, ".metadata") as stream:
        before = status_of(stream)
        stream.read()
        check_same(stream, before, ".metadata")
        subprocess.run(["sh", "-c", 'printf "more" >> "$0"', str(path)], check=True)  # another process saving
        with pytest.raises(InputError, match=r"^\.metadata: changed while being read"):
            check_same(stream, before, ".metadata")
