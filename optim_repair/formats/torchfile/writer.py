"""Writing a torch file with planned entries added: the edited graph pickled anew, every storage copied."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from optim_repair.dtypes import numel
from optim_repair.errors import InputError
from optim_repair.formats.pickled import Reduced, StorageRef, dump_graph, new_tensor, resolve, storage_for
from optim_repair.formats.torchfile.files import TorchFile, open_torch_file
from optim_repair.formats.torchfile.legacy import LegacyTorchFile, write_legacy
from optim_repair.formats.torchfile.zipformat import NewStorage, write_zip
from optim_repair.formats.unpickling import ZIP_ERRORS
from optim_repair.repair_plan import Addition, FreshTensor


def entry_slots(optimizer: dict[Any, Any], addition: Addition) -> tuple[tuple[Any, ...], list[Any]]:
    """Where an addition goes in the optimizer state dict at its address: the path of the dict that gains keys
    (relative to the optimizer), and those keys. Nested: ``state`` gains the parameter. Flattened
    (``flatten_optimizer_state_dict=True``): the optimizer gains one ``state.<name>.<key>`` key per value."""
    if "state" in optimizer and "param_groups" in optimizer:
        return ("state",), [addition.param]
    return (), [f"state.{addition.param}.{key}" for key in addition.keys]


def _sibling_location(optimizer: dict[Any, Any], key: str) -> str:
    """Where the optimizer keeps ``key`` for other parameters (``cuda:0``, or ``cpu`` for a CPU ``step``)."""
    if "state" in optimizer and "param_groups" in optimizer:
        values = [entry.get(key) for entry in optimizer["state"].values() if isinstance(entry, dict)]
    else:
        values = [value for name, value in optimizer.items() if name.startswith("state.") and name.endswith(f".{key}")]
    for value in values:
        if isinstance(value, Reduced) and value.args and isinstance(value.args[0], StorageRef):
            return value.args[0].location
    return "cpu"


def _add_entries(torch_file: TorchFile, additions: Sequence[Addition]) -> list[NewStorage]:
    """Add the planned entries to the graph; return the new storages, their sizes and their bytes."""
    legacy = isinstance(torch_file, LegacyTorchFile)
    taken = set(torch_file.graph.storages)
    created: list[NewStorage] = []
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
                created.append((ref, value.nbytes, value.chunks()))
            else:
                entry[key] = value
        where, keys = entry_slots(optimizer, addition)
        container = resolve(optimizer, where)
        if where:
            container[keys[0]] = entry
        else:
            container.update(zip(keys, entry.values(), strict=True))
    return created


def _remove_entries(torch_file: TorchFile, additions: Sequence[Addition]) -> None:
    """Undo ``_add_entries``: the graph is again the original's (the entries were added last)."""
    for addition in additions:
        optimizer = resolve(torch_file.graph.root, addition.address)
        where, keys = entry_slots(optimizer, addition)
        container = resolve(optimizer, where)
        for key in keys:
            del container[key]


def write_torch_file(
    src: Path,
    source: str,
    additions: Sequence[Addition],
    dest: Path,
    *,
    sync: bool = True,
    parsed: TorchFile | None = None,
    on_bytes: Callable[[int], None] = lambda nbytes: None,
) -> TorchFile:
    """Write ``src`` with ``additions`` applied to ``dest`` (created if need be): every other byte of
    meaning unchanged, synced to the disk unless ``sync`` is false.

    ``parsed`` is ``src`` as reading already parsed it. Returns the original as parsed, so that
    verification need not parse it again.
    """
    torch_file = parsed or open_torch_file(src, source)
    created = _add_entries(torch_file, additions)
    data = dump_graph(torch_file.graph.root, torch_file.graph.protocol)
    _remove_entries(torch_file, additions)
    # Opened without O_TRUNC: truncating a file and writing it anew makes ext4 flush it all at close.
    # An OSError (a full disk, ...) is the writer's to report: it names --out, not the temporary file.
    target = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        if os.fstat(target).st_size:
            os.ftruncate(target, 0)
        if isinstance(torch_file, LegacyTorchFile):
            write_legacy(torch_file, data, created, target, on_bytes)
        else:
            write_zip(torch_file, data, created, target, on_bytes)
        if sync:
            os.fsync(target)
    except ZIP_ERRORS as exc:
        raise InputError(f"damaged zip archive ({exc})", path=source) from exc
    finally:
        os.close(target)
    return torch_file
