"""A torch file's new pickle as the original's bytes, kept whole, with the added entries appended before its ``STOP``.

A plan that only adds state entries changes no byte of the original pickle: after its opcodes, and before its final
``STOP``, an appendix takes each edited state dict from the memo (``BINGET``) and sets the new entries in it
(``SETITEMS``). torch's weights-only loader has no ``POP``, so the appendix leaves the stack as it found it (the
root alone) by taking every container on the way from the root as well, and setting each back in place under its
own key (a dict keeps a key set again where it was): the root's ``optimizer`` set to the optimizer, its ``state``
to the state dict, which now holds the new entries after the old ones. So the root and every container on the
way must be dicts, and each must be in the memo, as ``torch.save`` leaves every dict; otherwise, and for a plan
that renames, drops, replaces or joins a group, the writer pickles the edited graph anew (``writer``).

Writing costs what the additions cost, and the verifier (``appendix_proof``) proves the kept bytes by position.
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Iterable, Sequence
from typing import Any

from optim_repair.formats.addresses import resolve
from optim_repair.formats.pickle_writing import dump_parts
from optim_repair.formats.pickled import PickleGraph
from optim_repair.formats.torchfile.added import NewStorages
from optim_repair.formats.torchfile.appendix_paths import SETTABLE, by_address, target_path, whole_pickle
from optim_repair.formats.torchfile.rewrite import NewStorage
from optim_repair.formats.torchfile.zipformat import ZipTorchFile
from optim_repair.records import keys
from optim_repair.records.repair_plan import Addition


def memo_entries(graph: PickleGraph, wanted: Iterable[Any]) -> dict[int, int]:
    """The memo entry holding each of the ``wanted`` objects when the pickle ends, by the object's id."""
    ids = {id(value) for value in wanted}
    return {id(value): index for index, value in graph.memo().items() if id(value) in ids}


def memo_get(index: int) -> bytes:
    """The opcode that pushes memo entry ``index``."""
    return pickle.BINGET + bytes([index]) if index < 256 else pickle.LONG_BINGET + struct.pack("<I", index)


def entry_items(optimizer: Any, addition: Addition, values: Sequence[Any]) -> list[Any]:
    """The keys and values, one after the other, that ``addition`` sets in the dict ``target_path`` names."""
    if keys.is_nested(optimizer):
        return [addition.param, dict(zip(addition.keys, values, strict=True))]
    items = []
    for key, value in zip(addition.keys, values, strict=True):
        items += [keys.flat_key(keys.STATE, addition.param, key), value]
    return items


def appended_pickle(torch_file: ZipTorchFile, additions: Sequence[Addition]) -> tuple[bytes, list[NewStorage]] | None:
    """The pickle of ``torch_file`` with ``additions`` appended, and the storages they create; None where the plan
    or the pickle does not allow it (see the module's text)."""
    root, data = torch_file.graph.root, torch_file.data
    plain = all(not (a.replaces or a.group is not None or a.like is not None) for a in additions)
    if not (additions and plain and type(root) in SETTABLE and whole_pickle(torch_file)):
        return None
    chains = []
    for address, mine in by_address(additions).items():
        optimizer = resolve(root, address)
        path = target_path(optimizer, address)
        containers = [resolve(root, path[:depth]) for depth in range(1, len(path) + 1)]
        if any(type(container) not in SETTABLE for container in containers):
            return None
        chains.append((optimizer, path, containers, mine))
    entries = memo_entries(torch_file.graph, (c for chain in chains for c in chain[2]))
    if any(id(c) not in entries for chain in chains for c in chain[2]):
        return None
    storages = NewStorages(torch_file)
    parts = [data[:-1]]
    for optimizer, path, containers, mine in chains:
        for key, container in zip(path, containers, strict=True):
            parts += [dump_parts([key]), memo_get(entries[id(container)])]
        items = [item for a in mine for item in entry_items(optimizer, a, storages.values(a, optimizer))]
        parts += [pickle.MARK, dump_parts(items), pickle.SETITEMS, pickle.SETITEM * len(path)]
    return b"".join([*parts, pickle.STOP]), storages.created
