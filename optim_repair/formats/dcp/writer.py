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

from optim_repair.errors import InputError, OutputError, RepairRefused
from optim_repair.formats.dcp.layout import PlannedEntries, plan_entries
from optim_repair.formats.dcp.metadata import METADATA_FILE, SHARD_SUFFIX, DcpMetadata, display_path
from optim_repair.formats.dcp.metadata_reader import read_metadata, unpickle_metadata
from optim_repair.repair_plan import AddedValue, Addition, FreshTensor


def _shard_name(src: Path) -> str:
    number = 0
    while (src / f"__optim_repair_{number}{SHARD_SUFFIX}").exists():
        number += 1
    return f"__optim_repair_{number}{SHARD_SUFFIX}"


def _serialized(value: AddedValue, key: str) -> bytes:
    """``torch.save`` of one planned value, as DCP stores a tensor or a bytes entry."""
    import torch

    buffer = io.BytesIO()
    if isinstance(value, FreshTensor):
        dtype = getattr(torch, value.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise RepairRefused(f"cannot create {key}: torch has no dtype {value.dtype!r}")
        data = b"".join(value.chunks())
        tensor = torch.frombuffer(bytearray(data), dtype=dtype) if data else torch.empty(0, dtype=dtype)
        torch.save(tensor.reshape(value.shape), buffer)
    else:
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
        with (dest / shard).open("wb") as stream:
            for entry in planned.entries:
                data = _serialized(entry.value, entry.key)
                info = _StorageInfo(shard, stream.tell(), len(data))
                stream.write(data)
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
            _flush(stream, sync=sync)
        with (dest / METADATA_FILE).open("wb") as stream:
            pickle.dump(metadata, stream)
            _flush(stream, sync=sync)
    except OSError as exc:
        raise OutputError(f"cannot write ({exc.strerror or exc})", path=str(dest)) from exc
