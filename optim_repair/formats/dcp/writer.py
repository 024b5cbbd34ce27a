"""Writing a repaired copy of a DCP checkpoint that stock ``dcp.load`` accepts; the one part that imports torch.

A repair never rewrites a shard: the copy keeps every original file, adds one shard holding the new
entries and a new ``.metadata`` describing old and new entries.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
from collections.abc import Sequence
from pathlib import Path

from optim_repair.errors import InputError, OutputError, RepairRefused
from optim_repair.formats.dcp.layout import PlannedEntries, plan_entries
from optim_repair.formats.dcp.metadata import METADATA_FILE, SHARD_SUFFIX, display_path
from optim_repair.formats.dcp.metadata_reader import read_metadata, unpickle_metadata
from optim_repair.repair_plan import AddedValue, Addition, FreshTensor


def _check_empty_destination(src: Path, dest: Path) -> None:
    if not dest.is_dir() or any(dest.iterdir()):
        raise OutputError("the destination must be an existing empty directory", path=str(dest))
    if dest.resolve().is_relative_to(src.resolve()):
        raise OutputError(f"the destination lies inside the checkpoint {src}", path=str(dest))


def _copy_tree(src: Path, dest: Path, *, link: bool, skip_metadata: bool) -> None:
    """Copy every file of ``src`` into ``dest``; shards hard-linked when ``link``."""

    def copy(source: str, target: str) -> None:
        if link and source.endswith(SHARD_SUFFIX):
            try:
                os.link(source, target)
            except OSError as exc:
                raise OutputError(
                    f"cannot hard-link {source} ({exc.strerror or exc}); "
                    "write the copy on the same file system, or copy instead of linking",
                    path=target,
                ) from exc
        else:
            shutil.copy2(source, target)

    def ignore(directory: str, names: list[str]) -> list[str]:
        return [METADATA_FILE] if skip_metadata and directory == os.fspath(src) else []

    try:
        shutil.copytree(src, dest, dirs_exist_ok=True, copy_function=copy, ignore=ignore)
    except shutil.Error as exc:
        raise OutputError(f"copying {src} failed ({exc})", path=str(dest)) from exc
    except OSError as exc:
        raise OutputError(f"copying {src} failed ({exc.strerror or exc})", path=str(dest)) from exc


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
        data = value.data()
        tensor = torch.frombuffer(bytearray(data), dtype=dtype) if data else torch.empty(0, dtype=dtype)
        torch.save(tensor.reshape(value.shape), buffer)
    else:
        torch.save(value, buffer)
    return buffer.getvalue()


def write_dcp(src: Path, additions: Sequence[Addition], dest: Path, *, link: bool) -> PlannedEntries:
    """Write into the empty directory ``dest`` a copy of the DCP directory ``src`` with ``additions``.

    Every file of ``src`` is copied byte-identical (shards hard-linked when ``link``); the new entries
    go into one new shard, and a new ``.metadata`` lists old and new entries. The original metadata
    is checked by the safe reader before torch unpickles it, with the same allowlist, into the real
    DCP classes that stock ``dcp.load`` expects. Returns the planned entries, for verification.
    """
    source = display_path(str(src), METADATA_FILE)
    planned = plan_entries(read_metadata(src, str(src)), additions, source)
    _check_empty_destination(src, dest)
    _copy_tree(src, dest, link=link, skip_metadata=bool(planned.entries))
    if planned.entries:
        _write_entries(src, planned, dest, source)
    return planned


def _write_entries(src: Path, planned: PlannedEntries, dest: Path, source: str) -> None:
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

    metadata = unpickle_metadata(src / METADATA_FILE, source, real=True)
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
        with (dest / METADATA_FILE).open("wb") as stream:
            pickle.dump(metadata, stream)
    except OSError as exc:
        raise OutputError(f"cannot write ({exc.strerror or exc})", path=str(dest)) from exc
