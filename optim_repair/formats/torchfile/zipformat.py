"""The zip format of ``torch.save``: ``<prefix>/data.pkl``, one stored record per storage, and framing records."""

from __future__ import annotations

import io
import itertools
import struct
import zipfile
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, ClassVar, Literal

from optim_repair.errors import InputError, NotATorchFile, TorchRefuses, shown
from optim_repair.formats.pickle_limits import check_pickle
from optim_repair.formats.pickle_opcodes import WEIGHTS_ONLY, OpcodeSet
from optim_repair.formats.pickled import PickleGraph, load_graph
from optim_repair.formats.unpickling import ZIP_ERRORS

GraphOf = Callable[[bytes], PickleGraph]
"""How a reader makes a pickle's bytes its graph (by default, ``load_graph``)."""
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
    data: bytes = b""
    """Its pickle's bytes, as they were read and parsed."""
    directory_at: int = 0
    """Where its central directory starts."""

    def storage_range(self, key: str) -> tuple[int, int]:
        """Byte offset and length of a storage's bytes in the file."""
        return self.offsets[key], self.graph.storages[key].nbytes

    def framing(self) -> dict[str, zipfile.ZipInfo]:
        """The records torch reads besides the pickle and the storages (``byteorder``, ``version``, ...)."""
        names = {info.filename[len(self.prefix) :]: info for info in self.records}
        return {name: info for name, info in names.items() if _is_framing(name)}


ZIP_MAGIC = b"PK\x03\x04"
MAX_PICKLE_BYTES = 512 << 20
"""The most a torch file's ``data.pkl`` may hold: far beyond the pickle of a million-parameter checkpoint."""
MAX_PICKLE_EXPANSION = 64
"""How many times its own size a deflated ``data.pkl`` may unpack to (beyond ``MIN_PICKLE_LIMIT``). torch stores
its pickle; re-zipped, a checkpoint's pickle (names, small numbers, memo references) packs to about a quarter."""
MIN_PICKLE_LIMIT = 1 << 20
MAX_FRAMING_BYTES = 1 << 20
"""The most a record other than the pickle and the storages may hold: torch writes a few bytes in each."""
_CHUNK = 1 << 20


def kept_records(torch_file: ZipTorchFile) -> list[zipfile.ZipInfo] | None:
    """The records a splice keeps, in the file's order: every one but the pickle, where torch laid the archive out
    (the pickle first, every record stored); None where it did not."""
    records = sorted(torch_file.records, key=lambda info: info.header_offset)
    first = records[0]
    stored = all(info.compress_type == zipfile.ZIP_STORED for info in records)
    if first.filename != f"{torch_file.prefix}data.pkl" or first.header_offset != 0 or not stored or len(records) < 2:
        return None
    return records[1:]


def data_offset(stream: BinaryIO, info: zipfile.ZipInfo, source: str) -> int:
    if info.header_offset < 0:  # the central directory says the archive begins before the file does
        raise InputError(f"damaged zip record {shown(info.filename)} (it begins before the file)", path=source)
    stream.seek(info.header_offset)
    header = stream.read(_LOCAL_HEADER.size)
    if len(header) != _LOCAL_HEADER.size or header[:4] != b"PK\x03\x04":
        raise InputError(f"damaged zip record {info.filename}", path=source)
    fields: tuple[int, ...] = _LOCAL_HEADER.unpack(header)
    return info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]


_UNREADABLE_FLAGS = 0x1 | 0x20 | 0x40 | 0x2000
"""Flags miniz, torch's zip reader, refuses ("unsupported encryption"): encrypted, patched data, strong encryption,
a masked local header."""
_DOS_DIRECTORY = 0x10
"""The external attribute that makes miniz take a record for a directory: torch then reads none of its bytes."""


def _is_framing(name: str) -> bool:
    return name != "data.pkl" and not name.startswith("data/")


def _check_end_record(stream: BinaryIO, start: int, records: list[zipfile.ZipInfo], source: str) -> None:
    """Refuse what miniz, torch's zip reader, refuses of the end record (zip64's where there is one) and Python's
    zipfile reads regardless: another disk ("unsupported multidisk archive"), or a directory holding fewer
    entries than the end record counts (an entry's lengths ran past it: "invalid header")."""
    end = zipfile._EndRecData(stream)  # type: ignore[attr-defined]  # stable since Python 2; zipfile's own parse
    if end is None:
        return  # zipfile has refused it already
    _check_zip64_locator(stream, end[zipfile._ECD_LOCATION], source)  # type: ignore[attr-defined]
    disk, directory_disk = end[zipfile._ECD_DISK_NUMBER], end[zipfile._ECD_DISK_START]  # type: ignore[attr-defined]
    here, total = end[zipfile._ECD_ENTRIES_THIS_DISK], end[zipfile._ECD_ENTRIES_TOTAL]  # type: ignore[attr-defined]
    if (disk | directory_disk) > 1 or here != total:
        raise TorchRefuses("its end record describes an archive of several disks", path=source)
    if total != len(records):
        raise TorchRefuses(f"its end record counts {total} records, its directory holds {len(records)}", path=source)
    size = end[zipfile._ECD_SIZE]  # type: ignore[attr-defined]
    stream.seek(start)
    directory, at = stream.read(size), 0
    for _ in records:  # each entry's own lengths must keep it inside the directory, as miniz checks
        if at + _CENTRAL_ENTRY > len(directory):
            break
        at += _CENTRAL_ENTRY + sum(struct.unpack_from("<3H", directory, at + 28))
    if at != size:
        raise TorchRefuses("the entries of its directory run past the size its end record gives it", path=source)


_ZIP64_LOCATOR = struct.Struct("<4sLQL")
"""The zip64 end locator before the end record: its signature, a disk, where the zip64 end record is, the disks."""
_ZIP64_END = 56


def _check_zip64_locator(stream: BinaryIO, end: int, source: str) -> None:
    """Refuse a zip64 end locator that miniz, torch's zip reader, refuses: one that puts the zip64 end record past
    the archive ("not a ZIP archive"). zipfile reads that record just before the locator, whatever it says."""
    if end < _ZIP64_LOCATOR.size:
        return
    stream.seek(end - _ZIP64_LOCATOR.size)
    signature, _, where, _ = _ZIP64_LOCATOR.unpack(stream.read(_ZIP64_LOCATOR.size))
    if signature != b"PK\x06\x07":
        return
    size = stream.seek(0, io.SEEK_END)
    if where > size - _ZIP64_END:
        raise TorchRefuses(f"its zip64 end locator puts the zip64 end record at {where}, past its end", path=source)


_CENTRAL_ENTRY = 46
"""The fixed part of a central-directory entry, before its name, extra field and comment."""


def _check_folder(records: list[zipfile.ZipInfo], source: str) -> None:
    """Refuse what torch's reader refuses of the archive's layout: it takes the folder of the first record for
    the archive's, every record must be in it, and it must hold ``data.pkl`` and a version record."""
    folder = records[0].filename.split("/", 1)[0] + "/"
    stray = next((info.filename for info in records if not info.filename.startswith(folder)), None)
    if stray is not None:
        raise TorchRefuses(f"record {shown(stray)} is not in the archive's folder {shown(folder)}", path=source)
    names = {info.filename for info in records}
    if folder + "data.pkl" not in names:
        raise TorchRefuses(f"its folder {shown(folder)} holds no data.pkl", path=source)
    if folder + "version" not in names and folder + ".data/version" not in names:
        raise TorchRefuses("it has no version record", path=source)


def _check_records(records: list[zipfile.ZipInfo], prefix: str, source: str) -> None:
    """Refuse what torch never writes and a reader could be fooled by: one name twice, an encrypted
    record, a compression method other than deflate, or a record besides the pickle and the storages
    that is large (a zip bomb)."""
    names: set[str] = set()
    for info in records:
        if info.filename in names:
            raise InputError(f"damaged zip archive (two records are named {shown(info.filename)})", path=source)
        names.add(info.filename)
        if info.volume not in (0, 1):  # miniz: "unsupported multidisk archive"
            raise TorchRefuses(f"record {shown(info.filename)} is on disk {info.volume} of several", path=source)
        if info.flag_bits & _UNREADABLE_FLAGS:
            raise TorchRefuses(f"record {shown(info.filename)} is marked encrypted or patched", path=source)
        if info.compress_type == zipfile.ZIP_STORED and info.compress_size != info.file_size:
            sizes = f"{info.compress_size} stored bytes for {info.file_size}"
            raise TorchRefuses(f"record {shown(info.filename)} is stored, yet its directory gives {sizes}", path=source)
        if info.external_attr & _DOS_DIRECTORY:
            marked = f"record {shown(info.filename)} is marked a directory: torch reads none of it"
            raise InputError(f"damaged zip archive ({marked})", path=source)
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            method = {zipfile.ZIP_BZIP2: "bzip2", zipfile.ZIP_LZMA: "lzma"}.get(info.compress_type, info.compress_type)
            reason = f"record {shown(info.filename)} is compressed with method {method}; torch never does that"
            raise InputError(reason, path=source)
        if _is_framing(info.filename[len(prefix) :]) and max(info.file_size, info.compress_size) > MAX_FRAMING_BYTES:
            raise InputError(
                f"record {shown(info.filename)} holds {info.file_size} bytes; torch writes only a few bytes there",
                path=source,
            )


def _check_disjoint(records: list[zipfile.ZipInfo], starts: Mapping[str, int], source: str) -> None:
    """Refuse records that share bytes: torch writes each once, one after another, and a storage read (or
    copied) through many names that share one record would be read (or written) as many times."""
    ordered = sorted(records, key=lambda info: info.header_offset)
    for before, after in itertools.pairwise(ordered):
        if after.header_offset < starts[before.filename] + before.compress_size:
            raise InputError(
                f"damaged zip archive (records {shown(before.filename)} and {shown(after.filename)} overlap); "
                "torch writes every record apart",
                path=source,
            )


def read_record(stream: BinaryIO, info: zipfile.ZipInfo, source: str, limit: int = MAX_FRAMING_BYTES) -> bytes:
    """A record's bytes, stored or deflated, checked against its size and CRC and never more than ``limit``,
    read from its local header: the archive's directory is not parsed again for them. A deflated record is
    unpacked a chunk at a time into one buffer, so that it is held once."""
    stream.seek(data_offset(stream, info, source))
    if info.compress_type == zipfile.ZIP_STORED:
        data = stream.read(min(info.compress_size, limit + 1))
    else:
        unpacked, decompressor, left = io.BytesIO(), zlib.decompressobj(-15), info.compress_size
        while left and unpacked.tell() <= limit:
            raw = stream.read(min(_CHUNK, left))
            if not raw:
                break
            left -= len(raw)
            try:
                unpacked.write(decompressor.decompress(raw, limit + 1 - unpacked.tell()))
            except zlib.error as exc:
                raise InputError(f"damaged zip archive (record {shown(info.filename)}: {exc})", path=source) from exc
        data = unpacked.getvalue()  # the buffer itself, not a copy
    if len(data) != info.file_size or zlib.crc32(data) != info.CRC:
        raise InputError(f"damaged zip archive (record {shown(info.filename)} fails its size or CRC)", path=source)
    return data


def _read_pickle(stream: BinaryIO, info: zipfile.ZipInfo, source: str) -> bytes:
    """The pickle record, read only up to a limit whatever its header claims: ``MAX_PICKLE_BYTES``, and for a
    deflated record ``MAX_PICKLE_EXPANSION`` times what it takes in the file."""
    limit = MAX_PICKLE_BYTES
    if info.compress_type != zipfile.ZIP_STORED:
        limit = min(limit, max(MIN_PICKLE_LIMIT, MAX_PICKLE_EXPANSION * info.compress_size))
    if info.file_size > limit:
        packed = "" if limit == MAX_PICKLE_BYTES else f" packed in {info.compress_size}"
        raise InputError(f"its pickle holds {info.file_size} bytes{packed}, more than {limit}", path=source)
    return read_record(stream, info, source, limit)


def _open_archive(stream: BinaryIO, source: str) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(stream)
    except ZIP_ERRORS as exc:
        raise InputError(f"damaged zip archive ({exc})", path=source) from exc


def _framing(archive: zipfile.ZipFile, stream: BinaryIO, source: str) -> tuple[zipfile.ZipInfo, str, dict[str, int]]:
    """Check the archive as torch's reader would, and read its framing records for their CRCs; return its
    ``data.pkl`` record, its folder and where each record's data starts. No pickle is read."""
    if archive.comment:  # torch's reader fails on some lengths (4,075 bytes after a 1,577-byte archive), not others
        reason = f"damaged zip archive (a comment of {len(archive.comment)} bytes, which torch.save never writes)"
        raise InputError(reason, path=source)
    records = archive.infolist()
    pickles = [info for info in records if info.filename.endswith("/data.pkl")]
    if not pickles:
        raise NotATorchFile("a zip archive without data.pkl is not a torch.save file", path=source)
    prefix = pickles[0].filename[: -len("data.pkl")]
    _check_end_record(stream, archive.start_dir, records, source)
    _check_folder(records, source)
    _check_records(records, prefix, source)
    starts = {info.filename: data_offset(stream, info, source) for info in records}
    _check_disjoint(records, starts, source)
    for framing in records:
        name = framing.filename[len(prefix) :]
        if _is_framing(name):  # read for its CRC: a damaged input is named as such, not its copy
            data = read_record(stream, framing, source)
            if name == "byteorder" and data not in (b"little", b"big"):
                raise TorchRefuses(f"its byteorder record says {shown(data)}, neither little nor big", path=source)
    return pickles[0], prefix, starts


_LOCAL_EXTRA = 128
"""What a reading plan allows a record's local extra field: torch pads it to align the data to 64 bytes."""
SMALL_RECORD = 64
"""A record this small (a ``step``) is planned whole, with its local header."""


def reading_plan(stream: BinaryIO) -> list[tuple[int, int]] | None:
    """The byte ranges ``open_zip`` and inspect will read of the archive in ``stream``, found from its central
    directory alone: each record's local header, and the whole of the pickle, the framing records and every
    record of ``SMALL_RECORD`` bytes or fewer; None when it is no zip archive."""
    try:
        with zipfile.ZipFile(stream) as archive:
            records = archive.infolist()
    except ZIP_ERRORS:
        return None
    plan = []
    for info in records:
        whole = "/data/" not in info.filename or info.compress_size <= SMALL_RECORD  # all but large storages
        header = _LOCAL_HEADER.size + len(info.orig_filename.encode()) + _LOCAL_EXTRA
        plan.append((info.header_offset, header + (info.compress_size if whole else 0)))
    return plan


def check_archive(stream: BinaryIO, source: str) -> None:
    """Check a ``torch.save`` archive's layout and framing as torch's reader would, and its pickle's opcodes
    (``check_pickle``, which executes nothing), without unpickling it: a DCP bytes entry that ``dcp.load``
    unpickles with ``weights_only=False``, which optim-repair never does."""
    with _open_archive(stream, source) as archive:
        pickle_record = _framing(archive, stream, source)[0]
        check_pickle(io.BytesIO(_read_pickle(stream, pickle_record, source)), source)


def open_zip(
    stream: BinaryIO,
    path: Path,
    source: str,
    *,
    ours: bool = False,
    graph_of: GraphOf | None = None,
    allowed: OpcodeSet = WEIGHTS_ONLY,
) -> ZipTorchFile:
    """Parse a zip-format torch file from its open ``stream`` (a file, or a DCP bytes entry in memory): its
    directory, its framing records and its pickle (by ``graph_of``, where given; of the opcodes ``allowed``,
    those of the reader that will read it); no storage bytes."""
    with _open_archive(stream, source) as archive:
        records = archive.infolist()
        pickle_record, prefix, starts = _framing(archive, stream, source)
        data = _read_pickle(stream, pickle_record, source)
        graph = graph_of(data) if graph_of else load_graph(data, source, ours=ours, allowed=allowed)
        by_name = {info.filename: info for info in records}
        offsets = {}
        size = stream.seek(0, io.SEEK_END)
        for key, ref in graph.storages.items():
            info = by_name.get(f"{prefix}data/{key}")
            if info is None:
                raise InputError(f"storage {key} has no record in the archive", path=source)
            if info.compress_type != zipfile.ZIP_STORED or info.file_size != ref.nbytes:
                raise InputError(
                    f"storage record {shown(info.filename)} holds {info.file_size} bytes, expected {ref.nbytes}",
                    path=source,
                )
            offsets[key] = starts[info.filename]
            if offsets[key] + ref.nbytes > size:
                raise InputError(f"storage record {shown(info.filename)} lies past the end of the file", path=source)
    return ZipTorchFile(path, graph, offsets, tuple(records), prefix, data, archive.start_dir)
