"""Writing a torch file with a plan applied: a new graph pickled, every storage it still names copied.

The graph reading parsed is never changed: the writer builds the edited optimizers anew (``changes``)
and pickles the new root, so that the verifier can compare the copy with the original as it was read.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from optim_repair.errors import InputError
from optim_repair.formats.addresses import resolve
from optim_repair.formats.pickle_writing import dump_graph, new_tensor, storage_for
from optim_repair.formats.pickled import Reduced, StorageRef, load_graph
from optim_repair.formats.torchfile.changes import changed_optimizer, put, with_entry
from optim_repair.formats.torchfile.files import TorchFile, open_torch_file
from optim_repair.formats.torchfile.legacy import LegacyTorchFile
from optim_repair.formats.torchfile.planning import plan_torch_file
from optim_repair.formats.torchfile.rewrite import NewStorage, write_legacy, write_zip
from optim_repair.formats.unpickling import ZIP_ERRORS
from optim_repair.records import keys
from optim_repair.records.dtypes import numel
from optim_repair.records.repair_plan import Addition, FreshTensor, ParamChange


def _sibling_location(optimizer: dict[Any, Any], key: str) -> str:
    """Where the optimizer keeps ``key`` for other parameters (``cuda:0``, or ``cpu`` for a CPU ``step``)."""
    if keys.is_nested(optimizer):
        values = (entry.get(key) for entry in optimizer[keys.STATE].values() if isinstance(entry, dict))
    else:
        values = (
            value
            for name, value in optimizer.items()
            if keys.section_of(name) == keys.STATE and keys.split_flat(name)[2] == key
        )
    for value in values:
        if isinstance(value, Reduced) and value.args and isinstance(value.args[0], StorageRef):
            return value.args[0].location
    return "cpu"


class _NewStorages:
    """The storages the additions create, each under a key the file does not use yet."""

    def __init__(self, torch_file: TorchFile) -> None:
        self._legacy = isinstance(torch_file, LegacyTorchFile)
        self._taken = set(torch_file.graph.storages)
        self.created: list[NewStorage] = []

    def tensor(self, value: FreshTensor, location: str) -> Reduced:
        key = f"optim-repair-{len(self.created)}" if self._legacy else str(len(self._taken))
        while key in self._taken:
            key += "_"
        self._taken.add(key)
        ref = storage_for(key, value.dtype, numel(value.shape), legacy=self._legacy, location=location)
        self.created.append(NewStorage(ref, value.nbytes, value.chunks()))
        return new_tensor(ref, value.shape)


def edited_root(
    torch_file: TorchFile, additions: Sequence[Addition], changes: Sequence[ParamChange]
) -> tuple[Any, list[NewStorage]]:
    """The graph's root with ``changes``, then ``additions`` applied, and the storages the additions create."""
    root = torch_file.graph.root
    storages = _NewStorages(torch_file)
    addresses = dict.fromkeys([*(change.address for change in changes), *(a.address for a in additions)])
    for address in sorted(addresses, key=len):
        original = resolve(torch_file.graph.root, address)
        optimizer = changed_optimizer(original, [change for change in changes if change.address == address])
        for addition in (addition for addition in additions if addition.address == address):
            values = [
                storages.tensor(value, _sibling_location(original, key)) if isinstance(value, FreshTensor) else value
                for key, value in addition.state
            ]
            with_entry(optimizer, addition, values)
        root = put(root, address, optimizer)
    return root, storages.created


def write_torch_file(
    src: Path,
    source: str,
    additions: Sequence[Addition],
    dest: Path,
    *,
    changes: Sequence[ParamChange] = (),
    parsed: TorchFile | None = None,
    on_bytes: Callable[[int], None] = lambda nbytes: None,
) -> None:
    """Write ``src`` with ``changes`` (renames, drops), then ``additions`` applied to ``dest`` (created if need
    be): every other byte of meaning unchanged. Syncing it to the disk is the caller's.

    ``parsed`` is ``src`` as reading parsed it; it is left as it was. The plan is checked first
    (``planning.plan_torch_file``), so that a refusal comes before any byte is written.
    """
    torch_file = parsed or open_torch_file(src, source)
    plan_torch_file(torch_file, source, additions, changes)
    root, created = edited_root(torch_file, additions, changes)
    data = dump_graph(root)
    replacing = any(addition.replaces for addition in additions) or any(c.new is None for c in changes)
    legacy = isinstance(torch_file, LegacyTorchFile)
    # the storages only a replaced or dropped entry held are not copied: the new pickle names them no more
    named = (
        set(load_graph(data, source, ours=True, legacy=legacy).storages)
        if replacing
        else set(torch_file.graph.storages)
    )
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
    except ZIP_ERRORS as exc:
        raise InputError(f"damaged zip archive ({exc})", path=source) from exc
    finally:
        os.close(target)
