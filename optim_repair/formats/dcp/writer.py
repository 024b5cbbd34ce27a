"""Writing what a repair adds to a DCP checkpoint: one new shard and a new ``.metadata``, without torch.

A repair never rewrites a shard: the copy keeps every original file (copied by ``optim_repair.checkpoint.writing``,
which follows the discovery list), and gains one shard holding the new entries and a new
``.metadata`` describing old and new entries, so that stock ``dcp.load`` accepts it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from optim_repair.errors import InputError, OutputError, os_error_reason
from optim_repair.formats.dcp.metadata import METADATA_FILE, REPAIR_SHARD_PREFIX, SHARD_SUFFIX, display_path
from optim_repair.formats.dcp.metadata_memo import memo_objects
from optim_repair.formats.dcp.metadata_older import without_strides
from optim_repair.formats.dcp.metadata_writer import Place, extended_metadata, rebuilt_metadata
from optim_repair.formats.dcp.planning import PlannedEntries
from optim_repair.formats.pickle_writing import dump_graph, new_tensor, storage_for
from optim_repair.formats.torchfile.zipwriter import ZipWriter
from optim_repair.records.dtypes import numel
from optim_repair.records.repair_plan import AddedValue, FreshTensor
from optim_repair.storage.disk import write_all


def _shard_name(taken: Callable[[str], bool]) -> str:
    number = 0
    while taken(f"{REPAIR_SHARD_PREFIX}{number}{SHARD_SUFFIX}"):
        number += 1
    return f"{REPAIR_SHARD_PREFIX}{number}{SHARD_SUFFIX}"


_EPOCH = (1980, 0, 0, 0, 0, 0)
"""The date torch.save gives every record."""


def _write_archive(target: int, base: int, root: object, storage: FreshTensor | None) -> int:
    """Write at ``base`` what ``torch.save`` writes for ``root`` (a tensor over ``storage``'s bytes, or a
    plain value). A storage is streamed in chunks, so that a fresh moment of any size takes bounded
    memory. Returns the bytes written."""
    writer = ZipWriter(target, base)
    writer.add_bytes("archive/data.pkl", dump_graph(root), _EPOCH, 0)
    for name, content in ((".format_version", b"1"), (".storage_alignment", b"64"), ("byteorder", b"little")):
        writer.add_bytes(f"archive/{name}", content, _EPOCH, 0)
    if storage is not None:
        writer.add_chunks("archive/data/0", storage.nbytes, storage.chunks(), _EPOCH, 0)
    writer.add_bytes("archive/version", b"3\n", _EPOCH, 0)
    serialization_id = str(int.from_bytes(os.urandom(17), "little")).zfill(40)[:40].encode()
    writer.add_bytes("archive/.data/serialization_id", serialization_id, _EPOCH, 0)
    return writer.finish()


def _write_value(target: int, base: int, value: AddedValue) -> int:
    """Write at ``base`` the ``torch.save`` archive of one new entry's value; returns the bytes written."""
    if isinstance(value, FreshTensor):
        storage = storage_for("0", value.dtype, numel(value.shape), legacy=False)
        return _write_archive(target, base, new_tensor(storage, value.shape), value)
    return _write_archive(target, base, value, None)


def write_planned_dcp(
    src: Path,
    planned: PlannedEntries,
    dest: Path,
    *,
    taken: Callable[[str], bool] | None = None,
    name: str = METADATA_FILE,
) -> None:
    """Write into the directory ``dest`` the shard and the metadata file ``name`` (``.metadata``, or a rank's own)
    that ``planned`` holds for ``src``.

    The new shard's name is one ``taken`` says no file of the checkpoint has (by default: none in ``src``), and
    none in ``dest`` either: another rank's view may have written its own there.
    Writes nothing when there is nothing to change; every original file but ``.metadata`` is the caller's
    to copy: renames and drops rewrite no shard. The new ``.metadata`` is the original pickle, as the safe
    reader checked it, extended by the new entries, or (with changes) with its tables rebuilt from
    references to its own objects (``metadata_writer``); rewritten ``params`` lists and new entries go to
    one new shard. Syncing what it writes to the disk is the caller's.
    """
    if planned.rewrites_metadata:
        source = display_path(str(src), name)
        held = taken or (lambda shard: (src / shard).exists())
        _write_entries(planned, dest, source, lambda shard: held(shard) or (dest / shard).exists(), name)


def _write_entries(planned: PlannedEntries, dest: Path, source: str, taken: Callable[[str], bool], name: str) -> None:
    """Write the new shard, and the original metadata extended by the new entries."""
    extensible = planned.original.pickle
    if extensible is None:  # plan_dcp refused it
        raise InputError("its pickle does not keep the metadata tables where a repair can extend them", path=source)
    if planned.without_strides:
        extensible = without_strides(extensible, source)
    shard = _shard_name(taken)
    placed: dict[str, Place] = {}
    rekeyed = planned.rekeyed
    values: list[tuple[str, AddedValue]] = [(entry.key, entry.value) for entry in planned.entries]
    values += [(key, names) for key, names in rekeyed.params.items()]  # type: ignore[misc]
    try:
        if values:  # else no shard: the copy's ``.metadata`` changes alone
            descriptor = os.open(dest / shard, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
            try:
                position = 0
                for key, value in values:
                    length = _write_value(descriptor, position, value)
                    placed[key] = Place(shard, position, length)
                    position += length
            finally:
                os.close(descriptor)
        if rekeyed.rebuilds_tables:
            objects = memo_objects(extensible, source)
            data = rebuilt_metadata(extensible, objects, rekeyed, planned.entries, placed)
        else:
            data = extended_metadata(extensible, planned.entries, placed)
        descriptor = os.open(dest / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        try:
            write_all(descriptor, data, 0)
        finally:
            os.close(descriptor)
    except OSError as exc:
        raise OutputError(f"cannot write ({os_error_reason(exc)})", path=str(dest)) from exc
