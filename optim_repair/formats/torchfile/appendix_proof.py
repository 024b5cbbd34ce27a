"""Proving a torch file whose pickle was extended: the original's bytes kept by position, only the plan appended.

The copy's pickle must begin with every byte of the original's but its final ``STOP``, and end with a ``STOP``.
What lies between is unpickled on its own, after a prelude that stores in the memo, for each container the plan's
entries go in or pass through (found in the original's memo from the plan's addresses, never from the writer), an
empty stand-in, and leaves a stand-in for the root on the stack. It must leave the root's stand-in alone on the
stack, set in each stand-in on the way only the key of the next (in the copy: a container set again where it was,
which changes nothing), and in each edited dict only the planned entries, in the plan's order. The original's
objects cannot be reached from it otherwise, so nothing else can differ; the entries' values are checked by the
verifier with every other addition's, through ``Appended.entry``.
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from optim_repair.errors import VerificationError, shown
from optim_repair.formats.addresses import describe_address, resolve
from optim_repair.formats.pickled import PickleGraph, is_tensor, load_graph
from optim_repair.formats.torchfile.appendix_paths import SETTABLE, by_address, target_path, whole_pickle
from optim_repair.formats.torchfile.zipformat import ZipTorchFile
from optim_repair.records import keys
from optim_repair.records.repair_plan import Addition


@dataclass(frozen=True)
class Appended:
    """What an appendix was proven to add: the graph the verifier reads storages from, and each entry's values."""

    graph: PickleGraph
    """The original's storages and the appendix's new ones; its root is the stand-in of the original's root."""
    entries: dict[tuple[Any, ...], tuple[dict[Any, Any], bool]]
    """The items set in each edited optimizer's dict, and whether it is nested (its ``state``), by its address."""
    tensors: int
    """The original's tensors, every byte of which the kept pickle and storages prove unchanged (found in its memo)."""

    def entry(self, addition: Addition) -> list[tuple[Any, Any]]:
        """The keys and values the appendix gives ``addition``'s entry."""
        items, nested = self.entries[addition.address]
        if nested:
            entry = items[addition.param]
            return list(entry.items()) if isinstance(entry, dict) else []
        return [(key, items[keys.flat_key(keys.STATE, addition.param, key)]) for key in addition.keys]


def _expected(root: Any, additions: Sequence[Addition]) -> dict[tuple[Any, ...], list[Any]]:
    """The keys each edited dict must be given, in order, by the dict's path."""
    expected: dict[tuple[Any, ...], list[Any]] = {}
    for address, mine in by_address(additions).items():
        optimizer = resolve(root, address)
        path = target_path(optimizer, address)
        if keys.is_nested(optimizer):
            expected[path] = [addition.param for addition in mine]
        else:
            expected[path] = [keys.flat_key(keys.STATE, a.param, key) for a in mine for key in a.keys]
    return expected


def appended_entries(before: ZipTorchFile, data: bytes, additions: Sequence[Addition], source: str) -> Appended | None:
    """The proof of the copy's pickle ``data`` as ``before``'s with ``additions`` appended; None for a pickle that
    does not begin with the original's (written anew). Raises VerificationError for an appendix that does more."""
    original = before.data
    kept = len(original) - 1
    if not (whole_pickle(before) and len(data) > kept + 1 and data.endswith(pickle.STOP)):
        return None
    if not data.startswith(original[:kept]):
        return None

    def refuse(what: str) -> VerificationError:
        return VerificationError(f"the copy's appended pickle {what}", path=source)

    if any(a.replaces or a.group is not None or a.like is not None for a in additions):
        raise refuse("cannot add to a group's params, repeat hyperparameters or replace an entry as the plan does")
    root = before.graph.root
    expected = _expected(root, additions)
    containers = {path[:depth]: resolve(root, path[:depth]) for path in expected for depth in range(1, len(path) + 1)}
    if type(root) not in SETTABLE or any(type(c) not in SETTABLE for c in containers.values()):
        raise refuse("edits a container that is no dict")
    memo = before.graph.memo()
    wanted = {id(container) for container in containers.values()}
    found = {id(value): index for index, value in memo.items() if id(value) in wanted}
    if len(found) != len(wanted):
        raise refuse("edits a container the original's memo does not hold")
    # each stand-in an empty dict stored in its memo entry, the root's in one the original does not use
    indices = {**{path: found[id(container)] for path, container in containers.items()}, (): len(memo)}
    stands = [pickle.EMPTY_DICT + pickle.LONG_BINPUT + struct.pack("<I", index) for index in indices.values()]
    graph = load_graph(pickle.POP.join(stands) + data[kept:], source, ours=True)
    seeded = graph.memo()
    stand_ins = {path: seeded[index] for path, index in indices.items()}
    if graph.root is not stand_ins[()]:
        raise refuse("leaves other than the root on its stack")
    for path, stand_in in stand_ins.items():
        links = {p[-1]: s for p, s in stand_ins.items() if p[:-1] == path and p}
        planned = expected.get(path, [])
        if list(stand_in) != [*links, *planned] or any(stand_in[key] is not s for key, s in links.items()):
            where = describe_address(path) or "the root"
            raise refuse(f"sets keys {shown(list(stand_in))} in {where}, not {shown([*links, *planned])}")
    taken = set(graph.storages) & set(before.graph.storages)
    if taken:
        raise refuse(f"names the original's storages {shown(sorted(taken))} anew")
    entries = {}
    for address in by_address(additions):
        path = target_path(resolve(root, address), address)
        entries[address] = (stand_ins[path], path != address)
    tensors = sum(1 for value in memo.values() if is_tensor(value))
    return Appended(PickleGraph(graph.root, {**before.graph.storages, **graph.storages}), entries, tensors)
