"""Verifying a repaired DCP copy through its own new metadata: original entries, other files, new entries.

The copy's ``.metadata`` is read whole, or, where it is the original's with new entries appended, as the original's
bytes kept and its appendix read alone (``appendix_proof``).
"""

from __future__ import annotations

import io
import os
import zipfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from optim_repair.errors import InputError, VerificationError, shown
from optim_repair.formats.copied import same_file
from optim_repair.formats.dcp.appendix_proof import appended_metadata
from optim_repair.formats.dcp.metadata import (
    METADATA_FILE,
    DcpBytes,
    DcpChunk,
    DcpMetadata,
    DcpStorage,
    DcpTensor,
    StorageIndex,
    display_path,
)
from optim_repair.formats.dcp.metadata_reader import read_metadata
from optim_repair.formats.dcp.planning import NewEntry, PlannedEntries, Rekeyed
from optim_repair.formats.dcp.storage import LocalShards, read_ranges, read_saved_object, untransform
from optim_repair.formats.pickled import load_graph, tensor_meta
from optim_repair.records.dtypes import contiguous_strides
from optim_repair.records.repair_plan import FreshTensor
from optim_repair.records.verification import NOTHING, READ_EVERYTHING, HolderProof, Verification
from optim_repair.storage.disk import open_beneath, same_range
from optim_repair.storage.ranged import FileSlice


def _check_ranges(
    src: Path, dest: Path, original: DcpMetadata, copy: DcpMetadata, rekeyed: Rekeyed, holder: HolderProof
) -> int:
    """Every original entry's bytes, found through the copy's own metadata under its new key, are the original's
    (but those of dropped entries and rewritten ``params`` lists); each pair of shards is opened once and read in
    offset order (not at all when the copy's is a hard link to it). Where the ``holder`` proves every original
    shard's copy identical as a whole (a server-side copy, by the store's checksums), each entry must lie where it
    lay, in the copy of its own shard. Returns the bytes proven."""
    by_files: dict[tuple[str, str], list[tuple[str, DcpStorage, DcpStorage]]] = {}
    for index, info in original.storage.items():
        new = rekeyed.new_key(index[0])
        if new is None or index[0] in rekeyed.params:
            continue
        copied = copy.storage.get((new, index[1]))
        if copied is None or copied.transforms != info.transforms or copied.length != info.length:
            raise VerificationError(f"the bytes of {index[0]} differ from the original's", path=dest)
        by_files.setdefault((info.relative_path, copied.relative_path), []).append((index[0], info, copied))
    if holder.unchanged_files:
        for (original_file, copied_file), ranges in by_files.items():
            if original_file != copied_file or any(info.offset != copied.offset for _, info, copied in ranges):
                raise VerificationError(f"the bytes of {ranges[0][0]} moved from where they lay", path=dest)
        return sum(info.length for ranges in by_files.values() for _, info, _ in ranges)
    proven = 0
    for (original_file, copied_file), ranges in by_files.items():
        where = display_path(str(src), original_file)
        with open_beneath(src, original_file, where) as first, (dest / copied_file).open("rb") as second:
            a, b = os.fstat(first.fileno()), os.fstat(second.fileno())
            linked = (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
            for key, info, copied in sorted(ranges, key=lambda entry: entry[1].offset):
                same = linked and info.offset == copied.offset
                if not (same or same_range(first, info.offset, second, copied.offset, info.length)):
                    raise VerificationError(f"the bytes of {key} differ from the original's", path=dest)
                proven += info.length
    return proven


def _check_addition(dest: Path, copy: DcpMetadata, entry: NewEntry, property_fields: int) -> None:
    """The copy holds ``entry`` where its metadata says; a new tensor's ``TensorProperties`` have as many fields
    as the original's (``property_fields``), its strides contiguous where torch 2.15's record them."""
    item = copy.items.get(entry.key)
    if copy.path_of(entry.key) != entry.path:
        raise VerificationError(f"{entry.key} has the key path {copy.path_of(entry.key)}", path=dest)
    value = entry.value
    index: StorageIndex = (entry.key, tuple(0 for _ in value.shape) if isinstance(value, FreshTensor) else None)
    info = copy.storage.get(index)
    if info is None:
        raise VerificationError(f"{entry.key} is stored nowhere", path=dest)
    where = f"{display_path(str(dest), info.relative_path)}:{entry.key}"
    if isinstance(value, FreshTensor):
        strides = contiguous_strides(value.shape) if property_fields == 6 else None
        expected = DcpTensor(value.dtype, value.shape, (DcpChunk(index[1] or (), value.shape),), strides)
        if item != expected or info.transforms:
            raise VerificationError(f"{entry.key} is not a {value.dtype} tensor of shape {value.shape}", path=dest)
        _check_fresh_tensor(dest / info.relative_path, info, value, where)
        return
    _check_saved(dest, copy, entry.key, value)


def _check_saved(dest: Path, copy: DcpMetadata, key: str, value: object) -> None:
    """The bytes entry ``key`` of the copy holds ``value`` (a plain value, or a rewritten ``params`` list)."""
    info = copy.storage.get((key, None))
    if info is None or copy.items.get(key) != DcpBytes():
        raise VerificationError(f"{key} is stored nowhere", path=dest)
    where = f"{display_path(str(dest), info.relative_path)}:{key}"
    data = dict(read_ranges(LocalShards(dest), {key: info}, str(dest)))[key]
    saved = read_saved_object(untransform(data, info.transforms, where), where).root
    if type(saved) is not type(value) or saved != value:
        raise VerificationError(f"{key} does not hold {shown(value)}", path=dest)


def _check_fresh_tensor(shard: Path, info: DcpStorage, value: FreshTensor, where: str) -> None:
    """The ``torch.save`` archive at ``info`` holds a ``value``-shaped tensor of its fill, read in chunks."""
    with (
        shard.open("rb") as stream,
        zipfile.ZipFile(io.BufferedReader(FileSlice(stream, info.offset, info.length))) as archive,
    ):
        pickles = [name for name in archive.namelist() if name.endswith("/data.pkl")]
        if len(pickles) != 1:
            raise VerificationError("is not a torch.save archive", path=where)
        meta = tensor_meta(load_graph(archive.read(pickles[0]), where, ours=True).root)
        if meta is None or (meta.dtype, meta.shape) != (value.dtype, value.shape) or not meta.in_bounds:
            raise VerificationError(f"is not a {value.dtype} tensor of shape {value.shape}", path=where)
        with archive.open(f"{pickles[0][: -len('data.pkl')]}data/{meta.storage}") as record:
            if any(record.read(len(chunk)) != chunk for chunk in value.chunks()) or record.read(1):
                raise VerificationError(f"does not hold {shown(value.fill)} everywhere", path=where)


def verify_planned_dcp(
    src: Path, dest: Path, planned: PlannedEntries, *, holder: HolderProof = READ_EVERYTHING
) -> Verification:
    """``verify_views`` for a checkpoint with one ``.metadata``."""
    return verify_views(src, dest, ((METADATA_FILE, planned),), holder=holder)


def verify_views(
    src: Path, dest: Path, views: Sequence[tuple[str, PlannedEntries]], *, holder: HolderProof = READ_EVERYTHING
) -> Verification:
    """Prove, through ``dest``'s own new metadata (each of ``views``: a metadata file's name and its plan; one a
    rank for a checkpoint saved without collectives), that every original entry's bytes are unchanged, every other
    file is identical and the planned entries are present; raise ``VerificationError`` if not. The copy's
    metadata and every file of it are read from disk. Counts the original tensor entries and the bytes of
    every original entry compared. Where the ``holder`` proves every file the repair does not write
    (``HolderProof.unchanged_files``: in object storage, by the store's checksums), ``dest`` holds only what the
    repair wrote."""
    verification = NOTHING
    try:
        for name, planned in views:
            verification += _verify_entries(src, dest, planned, holder, name)
        if not holder.unchanged_files:
            shards = {info.relative_path for _, planned in views for info in planned.original.storage.values()}
            _verify_members(src, dest, shards, {name for name, _ in views})
    except (InputError, OSError) as exc:
        raise VerificationError(f"the copy cannot be read back ({exc})", path=str(dest)) from exc
    return verification


def _verify_members(src: Path, dest: Path, shards: set[str], metadata: set[str], rel: str = "") -> None:
    """Every file of the checkpoint is in the copy: links as the same links (or, followed, as what they reach),
    ``shards`` as long, the rest byte-identical.

    The bytes of every stored entry are compared through the metadata; each file of ``metadata`` is compared
    there. A directory is descended into only where the copy holds a directory, so the walk ends with the copy.
    """
    try:
        names = sorted(os.listdir(src / rel if rel else src))
    except OSError as exc:
        raise VerificationError(f"the original cannot be listed ({exc.strerror})", path=str(src / rel)) from exc
    for name in names:
        member = f"{rel}/{name}" if rel else name
        source, target = src / member, dest / member
        if source.is_symlink() and (target.is_symlink() or not source.exists()):
            if not target.is_symlink() or os.readlink(target) != os.readlink(source):
                raise VerificationError(f"is not the link {source} is", path=target)
        elif source.is_dir():
            if not target.is_dir() or target.is_symlink():
                raise VerificationError("is not a directory", path=target)
            _verify_members(src, dest, shards, metadata, member)
        elif target.is_symlink():
            raise VerificationError(f"is a link where {source} is a file", path=target)
        elif member in shards:
            if not target.is_file() or target.stat().st_size != source.stat().st_size:
                raise VerificationError("the shard's size differs from the original's", path=target)
        elif member not in metadata and not same_file(source, target):
            raise VerificationError(f"differs from {source}", path=target)


def _verify_entries(
    src: Path, dest: Path, planned: PlannedEntries, holder: HolderProof, name: str = METADATA_FILE
) -> Verification:
    original, entries, rekeyed = planned.original, planned.entries, planned.rekeyed
    copy = appended_metadata(dest, planned, name) or read_metadata(dest, str(dest), ours=True, name=name)
    renamed = {key: rekeyed.new_key(key) for key in original.items}
    expected = {new for new in renamed.values() if new is not None} | {entry.key for entry in entries}
    expected |= set(rekeyed.aliases)
    if set(copy.items) != expected:
        extra, missing = sorted(set(copy.items) - expected), sorted(expected - set(copy.items))
        raise VerificationError(f"the copy's keys differ (unexpected {extra[:3]}, missing {missing[:3]})", path=dest)
    for key, item in original.items.items():
        new = renamed[key]
        if new is None:
            continue
        path = rekeyed.paths[new] if new != key else original.path_of(key)
        if planned.without_strides and isinstance(item, DcpTensor):
            item = replace(item, strides=None)  # the form a torch before 2.15 reads
        if copy.items[new] != item or copy.path_of(new) != path:
            raise VerificationError(f"the metadata of {key} changed", path=dest)
    compared = _check_ranges(src, dest, original, copy, rekeyed, holder)
    property_fields = original.pickle.property_fields if original.pickle and not planned.without_strides else 5
    for entry in entries:
        _check_addition(dest, copy, entry, property_fields)
    for key, names in rekeyed.params.items():
        _check_saved(dest, copy, key, names)
    for alias, (shared, path) in rekeyed.aliases.items():
        same_bytes = copy.storage.get((alias, None)) == original.storage.get((shared, None))
        if copy.items[alias] != original.items[shared] or copy.path_of(alias) != path or not same_bytes:
            raise VerificationError(f"{alias} does not share the bytes of {shared}", path=dest)
    tensors = sum(isinstance(item, DcpTensor) for item in original.items.values())
    return Verification(tensors=tensors, bytes=compared)
