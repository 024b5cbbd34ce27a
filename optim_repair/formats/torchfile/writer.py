"""Writing a torch file with planned entries added: the edited graph pickled anew, every storage copied."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from optim_repair.dtypes import numel
from optim_repair.errors import InputError
from optim_repair.formats.pickled import Reduced, StorageRef, dump_graph, new_tensor, resolve, storage_for
from optim_repair.formats.torchfile.files import TorchFile, open_torch_file
from optim_repair.formats.torchfile.legacy import LegacyTorchFile, write_legacy
from optim_repair.formats.torchfile.zipformat import write_zip
from optim_repair.formats.unpickling import ZIP_ERRORS
from optim_repair.repair_plan import Addition, FreshTensor


def _sibling_location(state: dict[Any, Any], key: str) -> str:
    """Where the optimizer keeps ``key`` for other parameters (``cuda:0``, or ``cpu`` for a CPU ``step``)."""
    for entry in state.values():
        value = entry.get(key) if isinstance(entry, dict) else None
        if isinstance(value, Reduced) and value.args and isinstance(value.args[0], StorageRef):
            return value.args[0].location
    return "cpu"


def _add_entries(torch_file: TorchFile, additions: Sequence[Addition]) -> list[tuple[StorageRef, bytes]]:
    """Add the planned entries to the graph; return the new storages and their bytes."""
    legacy = isinstance(torch_file, LegacyTorchFile)
    taken = set(torch_file.graph.storages)
    created: list[tuple[StorageRef, bytes]] = []
    for addition in additions:
        state = resolve(torch_file.graph.root, addition.address)["state"]
        entry: dict[str, Any] = {}
        for key, value in addition.state:
            if isinstance(value, FreshTensor):
                location = _sibling_location(state, key)
                storage_key = f"optim-repair-{len(created)}" if legacy else str(len(taken))
                while storage_key in taken:
                    storage_key += "_"
                taken.add(storage_key)
                ref = storage_for(storage_key, value.dtype, numel(value.shape), legacy=legacy, location=location)
                entry[key] = new_tensor(ref, value.shape)
                created.append((ref, value.data()))
            else:
                entry[key] = value
        state[addition.param] = entry
    return created


def write_torch_file(src: Path, source: str, additions: Sequence[Addition], dest: Path) -> None:
    """Write ``src`` with ``additions`` applied to ``dest``: every other byte of meaning unchanged."""
    torch_file = open_torch_file(src, source)
    created = _add_entries(torch_file, additions)
    data = dump_graph(torch_file.graph.root, torch_file.graph.protocol)
    # An OSError (a full disk, ...) is the writer's to report: it names --out, not the temporary file.
    try:
        if isinstance(torch_file, LegacyTorchFile):
            write_legacy(torch_file, data, created, dest)
        else:
            write_zip(torch_file, data, created, dest)
    except ZIP_ERRORS as exc:
        raise InputError(f"damaged zip archive ({exc})", path=source) from exc
