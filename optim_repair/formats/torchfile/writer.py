"""Writing a torch file with planned entries added: the edited graph pickled anew, every storage copied."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from optim_repair.errors import InputError, RepairRefused, shown
from optim_repair.formats.inputs import open_regular
from optim_repair.formats.pickled import (
    Reduced,
    StorageRef,
    dump_graph,
    load_graph,
    new_tensor,
    resolve,
    storage_for,
    tensor_meta,
)
from optim_repair.formats.torchfile.changes import Undo as SwapUndo
from optim_repair.formats.torchfile.changes import changed_optimizer, put, restore
from optim_repair.formats.torchfile.files import TorchFile, open_torch_file
from optim_repair.formats.torchfile.legacy import LegacyTorchFile
from optim_repair.formats.torchfile.rewrite import NewStorage, write_legacy, write_zip
from optim_repair.formats.unpickling import ZIP_ERRORS
from optim_repair.records.dtypes import itemsize, numel
from optim_repair.records.repair_plan import Addition, FreshTensor, ParamChange


def entry_edit(optimizer: dict[Any, Any], addition: Addition) -> tuple[tuple[Any, ...], list[Any], list[Any]]:
    """How an addition changes the optimizer state dict at its address: the path of the dict it edits (relative
    to the optimizer), the keys it removes there, and the keys it sets (in place when they exist, else
    appended). Nested: ``state`` gets the parameter's entry. Flattened (``flatten_optimizer_state_dict=True``):
    the optimizer gets one ``state.<name>.<key>`` key per value; a replacement removes the keys it does not set."""
    if "state" in optimizer and "param_groups" in optimizer:
        return ("state",), [], [addition.param]
    prefix = f"state.{addition.param}."
    new = [prefix + key for key in addition.keys]
    old = [
        key
        for key in optimizer
        if addition.replaces and key.startswith(prefix) and "." not in key[len(prefix) :]  # not "state.<name>.x.y"
    ]
    return (), [key for key in old if key not in new], new


def _sibling_location(optimizer: dict[Any, Any], key: str) -> str:
    """Where the optimizer keeps ``key`` for other parameters (``cuda:0``, or ``cpu`` for a CPU ``step``)."""
    if "state" in optimizer and "param_groups" in optimizer:
        values = (entry.get(key) for entry in optimizer["state"].values() if isinstance(entry, dict))
    else:
        values = (value for name, value in optimizer.items() if name.startswith("state.") and name.endswith(f".{key}"))
    for value in values:
        if isinstance(value, Reduced) and value.args and isinstance(value.args[0], StorageRef):
            return value.args[0].location
    return "cpu"


def _phantom_moments_are_zero(
    torch_file: TorchFile, stream: BinaryIO, old: Sequence[tuple[str, Any]], addition: Addition
) -> None:
    """Before a phantom-step entry is replaced: every byte of its moments is zero (inspect read their heads).
    ``old`` is the entry's keys and values."""
    for key, value in old:
        meta = tensor_meta(value)
        if meta is None or key == "step":
            continue
        offset, _ = torch_file.storage_range(meta.storage)
        stream.seek(offset + meta.storage_offset * itemsize(meta.dtype))
        left = meta.nbytes
        while left:
            chunk = stream.read(min(left, 16 << 20))
            if not chunk or any(chunk):
                raise RepairRefused(
                    f"{shown(addition.param)} at {addition.location or 'the top level'} has a moment that is not all "
                    "zero: not a phantom step's state, so it is not reset"
                )
            left -= len(chunk)


def _add_entries(torch_file: TorchFile, additions: Sequence[Addition], src: Path, saved: Undo) -> list[NewStorage]:
    """Add the planned entries to the graph, keeping in ``saved`` what each edited dict held before; return the
    new storages, their sizes and their bytes."""
    legacy = isinstance(torch_file, LegacyTorchFile)
    taken = set(torch_file.graph.storages)
    created: list[NewStorage] = []
    with open_regular(src, str(src)) as stream:
        for addition in additions:
            optimizer = resolve(torch_file.graph.root, addition.address)
            entry: dict[str, Any] = {}
            for key, value in addition.state:
                if isinstance(value, FreshTensor):
                    location = _sibling_location(optimizer, key)
                    storage_key = f"optim-repair-{len(created)}" if legacy else str(len(taken))
                    while storage_key in taken:
                        storage_key += "_"
                    taken.add(storage_key)
                    ref = storage_for(storage_key, value.dtype, numel(value.shape), legacy=legacy, location=location)
                    entry[key] = new_tensor(ref, value.shape)
                    created.append(NewStorage(ref, value.nbytes, value.chunks()))
                else:
                    entry[key] = value
            where, removed, keys = entry_edit(optimizer, addition)
            container = resolve(optimizer, where)
            if id(container) not in saved:
                saved[id(container)] = (container, list(container.items()))
            if addition.replaces:
                old = (
                    list(container[keys[0]].items())
                    if where
                    else [(key.rpartition(".")[2], container[key]) for key in (*removed, *keys) if key in container]
                )
                _phantom_moments_are_zero(torch_file, stream, old, addition)
            for key in removed:
                del container[key]
            if where:
                container[keys[0]] = entry
            else:
                container.update(zip(keys, entry.values(), strict=True))
            if addition.like is not None:  # flattened: the group's hyperparameters, repeated for the new parameter
                prefix = f"param_groups.{addition.like}."
                container.update(
                    {
                        f"param_groups.{addition.param}.{key[len(prefix) :]}": value
                        for key, value in list(container.items())
                        if key.startswith(prefix) and "." not in key[len(prefix) :]
                    }
                )
            elif addition.group is not None:  # a parameter in no group: the group's params list is a new one
                optimizer["param_groups"][addition.group]["params"].append(addition.param)
    return created


Undo = dict[int, tuple[dict[Any, Any], list[tuple[Any, Any]]]]
"""Each dict the additions edited, by id, with its items before: restoring them gives the original graph back."""


def _undo(saved: Undo) -> None:
    for container, items in saved.values():
        container.clear()
        container.update(items)


def write_torch_file(
    src: Path,
    source: str,
    additions: Sequence[Addition],
    dest: Path,
    *,
    changes: Sequence[ParamChange] = (),
    sync: bool = True,
    parsed: TorchFile | None = None,
    on_bytes: Callable[[int], None] = lambda nbytes: None,
) -> TorchFile:
    """Write ``src`` with ``changes`` (renames, drops), then ``additions`` applied to ``dest`` (created if need
    be): every other byte of meaning unchanged, synced to the disk unless ``sync`` is false.

    ``parsed`` is ``src`` as reading already parsed it. Returns the original as parsed, so that
    verification need not parse it again.
    """
    torch_file = parsed or open_torch_file(src, source)
    replacing = any(addition.replaces for addition in additions) or any(c.new is None for c in changes)
    if replacing and isinstance(torch_file, LegacyTorchFile):
        raise RepairRefused(
            "resetting a phantom step or dropping a parameter drops storages, which a legacy-format file must all "
            "keep (torch.load refuses a storage the pickle does not name); save it with torch.save's zip format",
            path=source,
        )
    graph = torch_file.graph
    original_root = graph.root
    edited = {a.address for a in additions if a.group is not None} | {c.address for c in changes}
    saved: Undo = {}
    swapped: SwapUndo = []
    try:
        for address in sorted(edited, key=len):
            mine = [change for change in changes if change.address == address]
            graph.root = put(graph.root, address, changed_optimizer(resolve(graph.root, address), mine), swapped)
        created = _add_entries(torch_file, additions, src, saved)
        data = dump_graph(graph.root, graph.protocol)
    finally:
        _undo(saved)
        restore(swapped)
        graph.root = original_root
    # the storages only a replaced or dropped entry held are not copied: the new pickle names them no more
    named = set(load_graph(data, source, ours=True).storages) if replacing else set(torch_file.graph.storages)
    dropped = frozenset(torch_file.graph.storages) - named
    # Opened without O_TRUNC: truncating a file and writing it anew makes ext4 flush it all at close.
    # An OSError (a full disk, ...) is the writer's to report: it names --out, not the temporary file.
    target = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        if os.fstat(target).st_size:
            os.ftruncate(target, 0)
        if isinstance(torch_file, LegacyTorchFile):
            write_legacy(torch_file, data, created, target, on_bytes)
        else:
            write_zip(torch_file, data, created, target, on_bytes, dropped=dropped)
        if sync:
            os.fsync(target)
    except ZIP_ERRORS as exc:
        raise InputError(f"damaged zip archive ({exc})", path=source) from exc
    finally:
        os.close(target)
    return torch_file
