"""The bytes of DCP shards: byte ranges read in offset order, stream transforms undone, ``torch.save`` objects parsed.

Of the shards, only the small bytes entries of optimizers (``param_groups`` and non-tensor state)
are read, each through the safe torch-pickle reader; tensor entries are never read for inspection.
"""

from __future__ import annotations

import importlib
import io
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from optim_repair.errors import InputError, os_error_reason, shown
from optim_repair.formats.dcp.metadata import METADATA_FILE, DcpMetadata, DcpStorage, display_path
from optim_repair.formats.pickle_opcodes import PICKLE
from optim_repair.formats.pickled import PickleGraph
from optim_repair.formats.torchfile.zipformat import ZIP_MAGIC, check_archive, open_zip
from optim_repair.formats.unpickling import ZIP_ERRORS
from optim_repair.storage.disk import open_beneath, size_of

MAX_BYTES_ENTRY = 64 << 20
"""The most one bytes entry (a ``torch.save``'d object: a param group, a ``params`` list, non-tensor
state) may hold, compressed or not: far beyond the list of a million parameter names."""


def _zstd_decompress(data: bytes, source: str) -> bytes:
    """Decompress a zstd frame, stopping past ``MAX_BYTES_ENTRY`` whatever the frame claims."""
    for module_name in ("compression.zstd", "zstandard"):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        try:
            if module_name == "compression.zstd":
                result = bytes(module.ZstdDecompressor().decompress(data, max_length=MAX_BYTES_ENTRY + 1))
            else:
                reader = module.ZstdDecompressor().stream_reader(io.BytesIO(data))
                result = bytes(reader.read(MAX_BYTES_ENTRY + 1))
        except Exception as exc:  # each zstd module raises its own error class
            raise InputError(f"corrupt zstd stream ({' '.join(str(exc).split())})", path=source) from exc
        if len(result) > MAX_BYTES_ENTRY:
            raise InputError(f"decompresses to more than {MAX_BYTES_ENTRY} bytes", path=source)
        return result
    raise InputError(
        "is zstd-compressed (stream.zstd/1); install the 'zstandard' package (or use Python 3.14+) to read it",
        path=source,
    )


def untransform(data: bytes, transforms: tuple[str, ...], source: str) -> bytes:
    """Undo DCP's stream transforms, in the order torch's reader applies them."""
    for descriptor in transforms:
        name, _, version = descriptor.partition("/")
        if name != "stream.zstd" or version.partition(".")[0] != "1":
            raise InputError(f"unknown stream transform {shown(descriptor)}", path=source)
        data = _zstd_decompress(data, source)
    return data


def _whole_archive(data: bytes, source: str) -> io.BytesIO:
    """A bytes entry as the archive it must be, exactly: ``dcp.save`` stores each one with its own length, and
    ``torch.load`` refuses an archive that bytes beyond its end record follow (a length in ``.metadata``
    that runs into the next entry)."""
    if not data.startswith(ZIP_MAGIC):
        raise InputError("not a torch.save archive", path=source)
    stream = io.BytesIO(data)
    try:
        end = zipfile._EndRecData(stream)  # type: ignore[attr-defined]  # zipfile's own parse; None if it has none
    except ZIP_ERRORS as exc:
        raise InputError(f"damaged zip archive ({exc})", path=source) from exc
    if end is not None:
        last = end[zipfile._ECD_LOCATION] + _END_RECORD + len(end[zipfile._ECD_COMMENT])  # type: ignore[attr-defined]
        if last != len(data):
            raise InputError(f"its length runs {len(data) - last} bytes past its archive", path=source)
    stream.seek(0)
    return stream


_END_RECORD = 22
"""The fixed size of a zip end of central directory record, before its comment."""


def read_saved_object(data: bytes, source: str) -> PickleGraph:
    """Parse the ``torch.save`` archive in ``data`` (a bytes entry) as a torch file is read: its records, its
    framing and its pickle, safely; ``dcp.load`` reads it with ``torch.load(weights_only=False)``, which checks
    as much, and reads every opcode of ``pickle``."""
    return open_zip(_whole_archive(data, source), Path(source), source, allowed=PICKLE).graph


class ShardFiles(Protocol):
    """Where a DCP checkpoint's shards are read: files of a directory (``LocalShards``), or objects in a store."""

    def size(self, relative: str, where: str) -> int:
        """The size of the shard ``relative`` (named ``where`` in messages)."""

    def read(self, relative: str, ranges: Sequence[tuple[int, int]], where: str) -> Iterator[bytes]:
        """The bytes of each ``(offset, length)`` of the shard ``relative``, each inside it, in the order given."""


class LocalShards:
    """The shards of a DCP directory on a file system, each opened beneath it as a regular file."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def size(self, relative: str, where: str) -> int:
        with open_beneath(self.directory, relative, where) as stream:
            return size_of(stream)

    def read(self, relative: str, ranges: Sequence[tuple[int, int]], where: str) -> Iterator[bytes]:
        try:
            with open_beneath(self.directory, relative, where) as stream:
                for offset, length in ranges:  # one at a time: a shard's entries are never all held at once
                    stream.seek(offset)
                    yield stream.read(length)
        except OSError as exc:
            raise InputError(f"cannot read ({os_error_reason(exc)})", path=where) from exc


def read_ranges(shards: ShardFiles, wanted: Mapping[str, DcpStorage], display: str) -> Iterator[tuple[str, bytes]]:
    """The bytes of each wanted bytes entry, reading each file once, in offset order; none longer than
    ``MAX_BYTES_ENTRY``."""
    by_file: dict[str, list[tuple[str, DcpStorage]]] = {}
    for key, info in wanted.items():
        by_file.setdefault(info.relative_path, []).append((key, info))
    for relative, reads in by_file.items():
        where = display_path(display, relative)
        size = shards.size(relative, where)
        reads.sort(key=lambda read: read[1].offset)
        for key, info in reads:
            if info.offset + info.length > size:
                raise InputError(f"truncated; {shown(key)} lies past its end", path=where)
            if info.length > MAX_BYTES_ENTRY:
                too_long = f"{shown(key)} holds {info.length} bytes, more than {MAX_BYTES_ENTRY}"
                raise InputError(too_long, path=where)
        data = shards.read(relative, [(info.offset, info.length) for _, info in reads], where)
        yield from zip((key for key, _ in reads), data, strict=True)


def check_ranges(shards: ShardFiles, meta: DcpMetadata, display: str) -> None:
    """Every stored range lies inside its shard (each shard is opened once, as a regular file)."""
    by_file: dict[str, list[tuple[str, int]]] = {}
    for (key, _), info in meta.storage.items():
        by_file.setdefault(info.relative_path, []).append((key, info.offset + info.length))
    for relative, (end, key) in meta.summarized.items():
        by_file.setdefault(relative, []).append((key, end))
    for relative, entries in by_file.items():
        where = display_path(display, relative)
        size = shards.size(relative, where)
        for key, end in entries:
            if end > size:
                raise InputError(f"truncated; {shown(key)} lies past its end", path=where)


def _bytes_entry_storage(meta: DcpMetadata, key: str, source: str) -> DcpStorage:
    info = meta.storage.get((key, None))
    if info is None:
        raise InputError(f"{key} is listed but stored nowhere", path=source)
    return info


def read_bytes_entries(
    shards: ShardFiles,
    meta: DcpMetadata,
    keys: Sequence[str],
    others: Sequence[str],
    rel: str,
    name: str = METADATA_FILE,
) -> dict[str, Any]:
    """The objects ``torch.save``'d in the bytes entries ``keys``, unpickled safely; each of ``others`` (those no
    optimizer holds: a scheduler's, a dataloader's) is checked as an archive ``dcp.load`` can open, as torch's
    reader checks it, and its pickle, which ``dcp.load`` unpickles with ``weights_only=False``, is not read.
    Each shard is read once for all of them.

    Entries with the same bytes (the flattened layout repeats each option for every parameter)
    are unpickled once.
    """
    source = display_path(rel, name)
    wanted = {key: _bytes_entry_storage(meta, key, source) for key in (*keys, *others)}
    unpickle = set(keys)
    values = {}
    unpickled: dict[tuple[bytes, tuple[str, ...]], Any] = {}
    for key, data in read_ranges(shards, wanted, rel):
        info = wanted[key]
        where = f"{display_path(rel, info.relative_path)}:{key}"
        if key not in unpickle:
            check_archive(_whole_archive(untransform(data, info.transforms, where), where), where)
        elif (data, info.transforms) not in unpickled:
            unpickled[data, info.transforms] = read_saved_object(untransform(data, info.transforms, where), where).root
        if key in unpickle:
            values[key] = unpickled[data, info.transforms]
    return values
