"""Writing the zip archive of a torch file: stored records only, data aligned on 64 bytes, as torch does.

Records are written one after another through a raw descriptor at tracked offsets: an unchanged
storage is moved by the kernel (``copy_file_range``) with the CRC-32 its original header gives, so that
its bytes never pass through Python; new records are streamed in bounded chunks with their CRC-32
computed on the way. The central directory and end records (zip64 where sizes or offsets need it)
follow the last record.
"""

from __future__ import annotations

import struct
import zipfile
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, replace

from optim_repair.storage.disk import kernel_copy, write_all

ALIGNMENT = 64
"""torch aligns every record's data on 64 bytes, so that storages can be memory-mapped."""
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_END = struct.Struct("<IHHHHIIH")
_END64 = struct.Struct("<IQHHIIQQQQ")
_LOCATOR64 = struct.Struct("<IIQI")
_LIMIT = 0xFFFFFFFF
_PADDING_FIELD = b"FB"
_UTF8_NAME = 0x800


@dataclass(frozen=True)
class _Written:
    name: bytes
    flags: int
    date_time: tuple[int, int, int, int, int, int]
    external_attr: int
    crc: int
    size: int
    offset: int


def _dos(date_time: tuple[int, int, int, int, int, int]) -> tuple[int, int]:
    year, month, day, hour, minute, second = date_time
    return hour << 11 | minute << 5 | second // 2, (year - 1980) << 9 | month << 5 | day


class ZipWriter:
    """Stored records written in order to the descriptor ``target``, then the central directory.

    The archive starts at ``base`` in the file (a DCP shard holds one archive per entry, back to back);
    offsets inside it are from its own start.
    """

    def __init__(self, target: int, base: int = 0) -> None:
        self._target = target
        self._base = base
        self._position = 0
        self._written: list[_Written] = []

    def _append(self, data: bytes) -> None:
        write_all(self._target, data, self._base + self._position)
        self._position += len(data)

    @property
    def position(self) -> int:
        """Where the next record starts, from the archive's start."""
        return self._position

    def _header(
        self,
        name: str,
        date_time: tuple[int, int, int, int, int, int],
        external_attr: int,
        size: int,
        crc: int,
        padding: int | None = None,
    ) -> int:
        """Write a local header whose data starts on an ``ALIGNMENT`` boundary (or after ``padding`` bytes of
        padding); return where the data starts."""
        encoded = name.encode("utf-8")
        flags = 0 if name.isascii() else _UTF8_NAME
        zip64 = size >= _LIMIT
        extra = struct.pack("<HHQQ", 1, 16, size, size) if zip64 else b""
        fixed = self._position + _LOCAL.size + len(encoded) + len(extra) + 4
        pad = -fixed % ALIGNMENT if padding is None else padding
        extra += _PADDING_FIELD + struct.pack("<H", pad) + b"Z" * pad
        time, date = _dos(date_time)
        stored = _LIMIT if zip64 else size
        version = 45 if zip64 else 20
        header = _LOCAL.pack(0x04034B50, version, flags, 0, time, date, crc, stored, stored, len(encoded), len(extra))
        self._written.append(_Written(encoded, flags, date_time, external_attr, crc, size, self._position))
        self._append(header + encoded + extra)
        return self._position

    def add_bytes(
        self,
        name: str,
        data: bytes,
        date_time: tuple[int, int, int, int, int, int],
        external_attr: int,
        *,
        padding: int | None = None,
    ) -> None:
        self._header(name, date_time, external_attr, len(data), zlib.crc32(data), padding)
        self._append(data)

    def skip(self, length: int, records: Iterable[zipfile.ZipInfo], moved: int) -> None:
        """Leave ``length`` bytes unwritten here, for records kept byte for byte from another archive, where each
        of ``records`` begins ``moved`` bytes after it began there; their central-directory entries are written
        as theirs were, at their new offsets. Every one must be stored."""
        for info in records:
            flags = info.flag_bits
            name = info.orig_filename.encode("utf-8" if flags & _UTF8_NAME else "cp437")
            entry = _Written(name, flags, info.date_time, info.external_attr, info.CRC, info.file_size, 0)
            self._written.append(replace(entry, offset=info.header_offset + moved))
        self._position += length

    def add_copy(
        self,
        name: str,
        source: int,
        offset: int,
        size: int,
        crc: int,
        date_time: tuple[int, int, int, int, int, int],
        external_attr: int,
        *,
        source_name: str,
    ) -> None:
        """A record whose ``size`` bytes are those at ``offset`` in ``source`` (the file ``source_name``), with the
        CRC-32 they have."""
        start = self._header(name, date_time, external_attr, size, crc)
        kernel_copy(source, self._target, offset, size, self._base + start, name=source_name)
        self._position = start + size

    def add_chunks(
        self,
        name: str,
        size: int,
        chunks: Iterable[bytes],
        date_time: tuple[int, int, int, int, int, int],
        external_attr: int,
    ) -> None:
        """A new record of ``size`` bytes, streamed; its CRC-32 is written into the header afterwards."""
        header_at = self._position
        start = self._header(name, date_time, external_attr, size, 0)
        crc = 0
        for chunk in chunks:
            crc = zlib.crc32(chunk, crc)
            self._append(chunk)
        if self._position - start != size:
            raise ValueError(f"{name}: {self._position - start} bytes streamed, {size} announced")
        write_all(self._target, struct.pack("<I", crc), self._base + header_at + 14)
        self._written[-1] = replace(self._written[-1], crc=crc)

    def finish(self) -> int:
        """Write the central directory and the end records; return the archive's size."""
        directory_at = self._position
        for record in self._written:
            fields = [value for value in (record.size, record.size) if value >= _LIMIT]
            offset = record.offset
            if offset >= _LIMIT:
                fields.append(offset)
                offset = _LIMIT
            extra = struct.pack(f"<HH{len(fields)}Q", 1, 8 * len(fields), *fields) if fields else b""
            stored = _LIMIT if record.size >= _LIMIT else record.size
            version = 45 if extra else 20
            time, date = _dos(record.date_time)
            made_by = 3 << 8 | version  # on Unix, as zipfile says
            header = _CENTRAL.pack(
                0x02014B50, made_by, version, record.flags, 0, time, date, record.crc, stored, stored,
                len(record.name), len(extra), 0, 0, 0, record.external_attr, offset,
            )  # fmt: skip
            self._append(header + record.name + extra)
        size, count = self._position - directory_at, len(self._written)
        if count >= 0xFFFF or size >= _LIMIT or directory_at >= _LIMIT:
            end64_at = self._position
            self._append(_END64.pack(0x06064B50, 44, 3 << 8 | 45, 45, 0, 0, count, count, size, directory_at))
            self._append(_LOCATOR64.pack(0x07064B50, 0, end64_at, 1))
            self._append(_END.pack(0x06054B50, 0, 0, 0xFFFF, 0xFFFF, _LIMIT, _LIMIT, 0))
        else:
            self._append(_END.pack(0x06054B50, 0, 0, count, count, size, directory_at, 0))
        return self._position
