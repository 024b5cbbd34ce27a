"""Rewriting a torch file's container around a new pickle: the zip records, or the legacy file's layout.

Every storage the new pickle still names keeps its bytes, moved by the kernel; new storages are streamed
in bounded chunks. Reading these containers is ``zipformat``'s and ``legacy``'s; this is the writer's.
"""

from __future__ import annotations

import pickle
import struct
import zipfile
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

from optim_repair.formats.pickled import StorageRef
from optim_repair.formats.torchfile.legacy import LegacyTorchFile
from optim_repair.formats.torchfile.zipformat import ZipTorchFile, data_offset, read_record
from optim_repair.formats.torchfile.zipwriter import ZipWriter
from optim_repair.storage.disk import kernel_copy, open_regular, write_all


class NewStorage(NamedTuple):
    """A storage a repair adds: its stand-in, its size in bytes, and its bytes in bounded chunks."""

    ref: StorageRef
    nbytes: int
    chunks: Iterable[bytes]


def write_zip(
    torch_file: ZipTorchFile,
    data: bytes,
    created: Sequence[NewStorage],
    target: int,
    on_bytes: Callable[[int], None] = lambda nbytes: None,
    *,
    dropped: frozenset[str] = frozenset(),
) -> None:
    """Write ``torch_file`` to the descriptor ``target`` with ``data`` as its pickle and ``created`` added, and
    without the records of the ``dropped`` storages (which ``data`` no longer names).

    Stored records keep their bytes and CRC-32 and are moved by the kernel; a deflated record (torch
    writes none; never more than ``MAX_FRAMING_BYTES``) is written stored. ``on_bytes`` hears of every
    record written, by its size.
    """
    writer = ZipWriter(target)
    with open_regular(torch_file.path, str(torch_file.path)) as raw:
        last_storage = max(
            (i for i, info in enumerate(torch_file.records) if info.filename.startswith(f"{torch_file.prefix}data/")),
            default=len(torch_file.records) - 1,
        )
        gone = {f"{torch_file.prefix}data/{key}" for key in dropped}
        for index, info in enumerate(torch_file.records):
            if info.filename == f"{torch_file.prefix}data.pkl":
                writer.add_bytes(info.filename, data, info.date_time, info.external_attr)
            elif info.filename in gone:
                on_bytes(info.file_size)  # not copied, but part of the work the progress counts
            elif info.compress_type == zipfile.ZIP_STORED:
                offset = data_offset(raw, info, str(torch_file.path))
                writer.add_copy(
                    info.filename, raw.fileno(), offset, info.file_size, info.CRC, info.date_time, info.external_attr,
                    source_name=str(torch_file.path),
                )  # fmt: skip
                on_bytes(info.file_size)
            else:
                record = read_record(raw, info, str(torch_file.path))
                writer.add_bytes(info.filename, record, info.date_time, info.external_attr)
            if index == last_storage:
                for ref, size, chunks in created:
                    name = f"{torch_file.prefix}data/{ref.key}"
                    writer.add_chunks(name, size, chunks, info.date_time, info.external_attr)
                    on_bytes(size)
        writer.finish()


def write_legacy(
    torch_file: LegacyTorchFile,
    data: bytes,
    created: Sequence[NewStorage],
    target: int,
    on_bytes: Callable[[int], None] = lambda nbytes: None,
) -> None:
    """Write ``torch_file`` to the descriptor ``target`` with ``data`` as its main pickle and ``created`` added."""
    keys = pickle.dumps([*torch_file.keys, *(ref.key for ref, _, _ in created)], protocol=2)
    with open_regular(torch_file.path, str(torch_file.path)) as source:
        kernel_copy(source.fileno(), target, 0, torch_file.main_start, 0, name=str(torch_file.path))
        position = torch_file.main_start
        for block in (data, keys):
            write_all(target, block, position)
            position += len(block)
        length = torch_file.storage_end - torch_file.storage_start
        kernel_copy(source.fileno(), target, torch_file.storage_start, length, position, name=str(torch_file.path))
        on_bytes(length)
        position += length
    for ref, size, chunks in created:
        write_all(target, struct.pack("<q", ref.numel), position)
        position += 8
        for chunk in chunks:
            write_all(target, chunk, position)
            position += len(chunk)
        on_bytes(size)
