"""The zip format of ``torch.save``: ``<prefix>/data.pkl``, one stored record per storage, and framing records."""

from __future__ import annotations

import struct
import zipfile
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, ClassVar, Literal

from optim_repair.errors import InputError, NotATorchFile, shown
from optim_repair.formats.inputs import size_of
from optim_repair.formats.pickled import PickleGraph, load_graph
from optim_repair.formats.unpickling import ZIP_ERRORS

_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")


@dataclass(frozen=True)
class ZipTorchFile:
    """A parsed zip-format torch file: its object graph and where each storage's bytes lie."""

    kind: ClassVar[Literal["torch-zip"]] = "torch-zip"
    path: Path
    graph: PickleGraph
    offsets: Mapping[str, int]
    """Where each storage's bytes start in the file, by storage key."""
    records: tuple[zipfile.ZipInfo, ...]
    prefix: str
    """The archive's top directory, with its slash (``archive/``)."""

    def storage_range(self, key: str) -> tuple[int, int]:
        """Byte offset and length of a storage's bytes in the file."""
        return self.offsets[key], self.graph.storages[key].nbytes

    def framing(self) -> dict[str, zipfile.ZipInfo]:
        """The records torch reads besides the pickle and the storages (``byteorder``, ``version``, ...)."""
        names = {info.filename[len(self.prefix) :]: info for info in self.records}
        return {name: info for name, info in names.items() if name != "data.pkl" and not name.startswith("data/")}


ZIP_MAGIC = b"PK\x03\x04"
MAX_PICKLE_BYTES = 512 << 20
"""The most a torch file's ``data.pkl`` may hold: far beyond the pickle of a million-parameter
checkpoint, and a bound on what a compressed pickle record may unpack to."""
MAX_FRAMING_BYTES = 1 << 20
"""The most a record other than the pickle and the storages may hold: torch writes a few bytes in each."""


def data_offset(stream: BinaryIO, info: zipfile.ZipInfo, source: str) -> int:
    stream.seek(info.header_offset)
    header = stream.read(_LOCAL_HEADER.size)
    if len(header) != _LOCAL_HEADER.size or header[:4] != b"PK\x03\x04":
        raise InputError(f"damaged zip record {info.filename}", path=source)
    fields: tuple[int, ...] = _LOCAL_HEADER.unpack(header)
    return info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]


def _check_records(records: list[zipfile.ZipInfo], prefix: str, source: str) -> None:
    """Refuse what torch never writes and a reader could be fooled by: one name twice, an encrypted
    record, a compression method other than deflate, or a record besides the pickle and the storages
    that is large (a zip bomb)."""
    names: set[str] = set()
    for info in records:
        if info.filename in names:
            raise InputError(f"damaged zip archive (two records are named {shown(info.filename)})", path=source)
        names.add(info.filename)
        if info.flag_bits & 0x1:
            raise InputError(f"damaged zip archive (record {shown(info.filename)} is marked encrypted)", path=source)
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            method = {zipfile.ZIP_BZIP2: "bzip2", zipfile.ZIP_LZMA: "lzma"}.get(info.compress_type, info.compress_type)
            reason = f"record {shown(info.filename)} is compressed with method {method}; torch never does that"
            raise InputError(reason, path=source)
        name = info.filename[len(prefix) :]
        framing = name != "data.pkl" and not name.startswith("data/")
        if framing and max(info.file_size, info.compress_size) > MAX_FRAMING_BYTES:
            raise InputError(
                f"record {shown(info.filename)} holds {info.file_size} bytes; torch writes only a few bytes there",
                path=source,
            )


def read_record(stream: BinaryIO, info: zipfile.ZipInfo, source: str) -> bytes:
    """A framing record's bytes (never more than ``MAX_FRAMING_BYTES``: ``_check_records``), stored or deflated,
    read from its local header: the archive's directory is not parsed again for them."""
    stream.seek(data_offset(stream, info, source))
    raw = stream.read(info.compress_size)
    stored = info.compress_type == zipfile.ZIP_STORED
    data = raw if stored else zlib.decompressobj(-15).decompress(raw, info.file_size + 1)
    if len(data) != info.file_size or zlib.crc32(data) != info.CRC:
        raise InputError(f"damaged zip archive (record {shown(info.filename)} fails its size or CRC)", path=source)
    return data


def _read_pickle(archive: zipfile.ZipFile, info: zipfile.ZipInfo, source: str) -> bytes:
    """The pickle record, read only up to ``MAX_PICKLE_BYTES`` whatever its header claims."""
    if info.file_size > MAX_PICKLE_BYTES:
        raise InputError(f"its pickle holds {info.file_size} bytes, more than {MAX_PICKLE_BYTES}", path=source)
    try:
        with archive.open(info) as record:
            data = record.read(MAX_PICKLE_BYTES + 1)
    except (*ZIP_ERRORS, OSError) as exc:
        raise InputError(f"damaged zip archive ({exc})", path=source) from exc
    if len(data) > MAX_PICKLE_BYTES:
        raise InputError(f"its pickle holds more than {MAX_PICKLE_BYTES} bytes", path=source)
    return data


def open_zip(stream: BinaryIO, path: Path, source: str, *, ours: bool = False) -> ZipTorchFile:
    """Parse a zip-format torch file from its open ``stream``: its pickle and its directory, no storage bytes."""
    try:
        archive = zipfile.ZipFile(stream)
    except ZIP_ERRORS as exc:
        raise InputError(f"damaged zip archive ({exc})", path=source) from exc
    with archive:
        records = archive.infolist()
        pickles = [info for info in records if info.filename.endswith("/data.pkl")]
        if not pickles:
            raise NotATorchFile("a zip archive without data.pkl is not a torch.save file", path=source)
        prefix = pickles[0].filename[: -len("data.pkl")]
        _check_records(records, prefix, source)
        graph = load_graph(_read_pickle(archive, pickles[0], source), source, ours=ours)
        by_name = {info.filename: info for info in records}
        offsets = {}
        size = size_of(stream)
        for key, ref in graph.storages.items():
            info = by_name.get(f"{prefix}data/{key}")
            if info is None:
                raise InputError(f"storage {key} has no record in the archive", path=source)
            if info.compress_type != zipfile.ZIP_STORED or info.file_size != ref.nbytes:
                raise InputError(
                    f"storage record {shown(info.filename)} holds {info.file_size} bytes, expected {ref.nbytes}",
                    path=source,
                )
            offsets[key] = data_offset(stream, info, source)
            if offsets[key] + ref.nbytes > size:
                raise InputError(f"storage record {shown(info.filename)} lies past the end of the file", path=source)
    return ZipTorchFile(path, graph, offsets, tuple(records), prefix)
