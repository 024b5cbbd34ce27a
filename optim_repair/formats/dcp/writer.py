"""Writing what a repair adds to a DCP checkpoint: one new shard and a new ``.metadata``; imports torch.

A repair never rewrites a shard: the copy keeps every original file (copied by ``optim_repair.output``,
which follows the discovery list), and gains one shard holding the new entries and a new
``.metadata`` describing old and new entries, so that stock ``dcp.load`` accepts it.
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

from optim_repair.dtypes import numel
from optim_repair.errors import InputError, OutputError
from optim_repair.formats.dcp.layout import PlannedEntries, plan_entries
from optim_repair.formats.dcp.metadata import METADATA_FILE, SHARD_SUFFIX, DcpMetadata, display_path
from optim_repair.formats.dcp.metadata_reader import read_metadata, unpickle_metadata
from optim_repair.formats.pickled import dump_graph, new_tensor, storage_for
from optim_repair.formats.ranges import write_all
from optim_repair.formats.torchfile.zipwriter import ZipWriter
from optim_repair.repair_plan import AddedValue, Addition, FreshTensor


def _shard_name(src: Path) -> str:
    number = 0
    while (src / f"__optim_repair_{number}{SHARD_SUFFIX}").exists():
        number += 1
    return f"__optim_repair_{number}{SHARD_SUFFIX}"


_EPOCH = (1980, 0, 0, 0, 0, 0)
"""The date torch.save gives every record."""


def _write_tensor(target: int, base: int, value: FreshTensor) -> int:
    """Write at ``base`` what ``torch.save`` writes for a tensor of ``value``'s dtype and shape whose every
    element is its fill, without building the tensor: its storage is streamed in chunks, so that a
    fresh moment of any size takes bounded memory. Returns the bytes written."""
    storage = storage_for("0", value.dtype, numel(value.shape), legacy=False)
    writer = ZipWriter(target, base)
    writer.add_bytes("archive/data.pkl", dump_graph(new_tensor(storage, value.shape), 2), _EPOCH, 0)
    for name, content in ((".format_version", b"1"), (".storage_alignment", b"64"), ("byteorder", b"little")):
        writer.add_bytes(f"archive/{name}", content, _EPOCH, 0)
    writer.add_chunks("archive/data/0", value.nbytes, value.chunks(), _EPOCH, 0)
    writer.add_bytes("archive/version", b"3\n", _EPOCH, 0)
    serialization_id = str(int.from_bytes(os.urandom(17), "little")).zfill(40)[:40].encode()
    writer.add_bytes("archive/.data/serialization_id", serialization_id, _EPOCH, 0)
    return writer.finish()


def _saved(value: AddedValue) -> bytes:
    """``torch.save`` of a plain value (a bytes entry)."""
    import torch

    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def write_dcp(
    src: Path,
    additions: Sequence[Addition],
    dest: Path,
    *,
    sync: bool = True,
    original: DcpMetadata | None = None,
) -> PlannedEntries:
    """Write into the directory ``dest`` the shard and ``.metadata`` that add ``additions`` to ``src``.

    Writes nothing when there is nothing to add; every original file but ``.metadata`` is the
    caller's to copy. The original metadata is checked by the safe reader before torch unpickles it,
    with the same allowlist, into the real DCP classes that stock ``dcp.load`` expects. Returns the
    planned entries, for verification. With ``sync``, what it writes is synced to the disk. ``original``
    is ``src``'s metadata as reading already read it.
    """
    source = display_path(str(src), METADATA_FILE)
    planned = plan_entries(original or read_metadata(src, str(src)), additions, source)
    if planned.entries:
        _write_entries(src, planned, dest, source, sync=sync)
    return planned


def _flush(stream: BinaryIO, *, sync: bool) -> None:
    stream.flush()
    if sync:
        os.fsync(stream.fileno())


def _write_entries(src: Path, planned: PlannedEntries, dest: Path, source: str, *, sync: bool) -> None:
    """Write the new shard, and the original metadata extended by the new entries."""

    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    metadata = unpickle_metadata(planned.original.pickle, source, real=True, ours=True)
    if not isinstance(metadata, Metadata) or metadata.planner_data is None or metadata.storage_data is None:
        raise InputError("not a DCP Metadata with planner and storage data", path=source)
    shard = _shard_name(src)
    try:
        descriptor = os.open(dest / shard, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        try:
            position = 0
            for entry in planned.entries:
                if isinstance(entry.value, FreshTensor):
                    length = _write_tensor(descriptor, position, entry.value)
                else:
                    data = _saved(entry.value)
                    write_all(descriptor, data, position)
                    length = len(data)
                info = _StorageInfo(shard, position, length)
                position += length
                if isinstance(entry.value, FreshTensor):
                    zeros = [0] * len(entry.value.shape)
                    metadata.state_dict_metadata[entry.key] = TensorStorageMetadata(
                        properties=TensorProperties(dtype=getattr(torch, entry.value.dtype)),
                        size=torch.Size(entry.value.shape),
                        chunks=[ChunkStorageMetadata(offsets=torch.Size(zeros), sizes=torch.Size(entry.value.shape))],
                    )
                    metadata.storage_data[MetadataIndex(entry.key, zeros, 0)] = info
                else:
                    metadata.state_dict_metadata[entry.key] = BytesStorageMetadata()
                    metadata.storage_data[MetadataIndex(entry.key)] = info
                metadata.planner_data[entry.key] = entry.path
            if sync:
                os.fsync(descriptor)
        finally:
            os.close(descriptor)
        with (dest / METADATA_FILE).open("wb") as stream:
            pickle.dump(metadata, stream)
            _flush(stream, sync=sync)
    except OSError as exc:
        raise OutputError(f"cannot write ({exc.strerror or exc})", path=str(dest)) from exc
