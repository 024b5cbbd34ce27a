"""Byte ranges read as files: a range of a file, files joined, an object of a store; one seek rule for all three, the
one a file has, so that ``zipfile`` judges each as it judges a file."""

from __future__ import annotations

import errno
import io
import os
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from optim_repair.storage.ranged import FileSlice, Joined, RangedObject, RangeFile
from optim_repair.storage.s3 import S3Store
from tests.factories import s3server

DATA = os.urandom(1000)


@pytest.fixture
def opened(server: s3server.Server, environment: None, tmp_path: Path) -> Iterator[dict[str, RangeFile]]:
    """The same 1000 bytes as each kind of byte-range file."""
    path = tmp_path / "data"
    path.write_bytes(b"before" + DATA + b"after")
    bucket = s3server.new_bucket(server)
    server.client().put_object(Bucket=bucket, Key="data", Body=DATA)
    store = S3Store(bucket)
    with path.open("rb") as whole, path.open("rb") as first, path.open("rb") as second:
        yield {
            "slice": FileSlice(whole, 6, len(DATA)),
            "joined": Joined([(first, 6, 400), (second, 406, 600)]),
            "object": RangedObject(store, "data", store.head("data")),
        }


@pytest.mark.parametrize("kind", ["slice", "joined", "object"])
def test_each_byte_range_file_seeks_and_reads_as_a_file_does(opened: dict[str, RangeFile], kind: str) -> None:
    stream, plain = opened[kind], io.BytesIO(DATA)
    for offset, whence in ((0, io.SEEK_END), (-10, io.SEEK_END), (5, io.SEEK_SET), (7, io.SEEK_CUR), (2000, 0)):
        assert stream.seek(offset, whence) == plain.seek(offset, whence)
        assert stream.read(100) == plain.read(100)
    stream.seek(0)
    assert stream.read() == DATA
    for offset, whence in ((-1, io.SEEK_SET), (-1001, io.SEEK_END)):
        with pytest.raises(OSError) as refused:
            stream.seek(offset, whence)
        assert refused.value.errno == errno.EINVAL  # as a file answers: zipfile takes it for no zip archive
    assert stream.tell() == len(DATA)


@pytest.mark.parametrize("kind", ["slice", "joined", "object"])
def test_zipfile_refuses_each_alike_when_it_holds_no_archive(opened: dict[str, RangeFile], kind: str) -> None:
    with pytest.raises(zipfile.BadZipFile):
        zipfile.ZipFile(io.BufferedReader(opened[kind]))
