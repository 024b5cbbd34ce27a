"""An unpickled object graph as leaves: each tensor where its bytes lie, each other value in a form compared by bits.

Dict keys and list indices become the parts of a leaf's path, as DCP's flattening names them (``optim.state.0``
for the key ``0`` and the index ``0`` alike). A container reached twice is listed under each path (torch's own
loader rebuilds it under each); one that holds itself is a leaf of its own. No I/O.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Hashable
from typing import Any

from optim_repair.errors import InputError, shown
from optim_repair.formats.pickled import GlobalRef, Reduced, StorageRef, tensor_meta
from optim_repair.formats.safe_globals import PickledObject
from optim_repair.records.inventory import TensorMeta
from optim_repair.records.leaves import Leaf, LeafPath, Piece, TensorLeaf, ValueLeaf, path_part

MAX_LEAVES = 1 << 23
"""The most leaves one file may list: far beyond the values of a million-parameter optimizer."""
LEAVES_PER_BYTE = 0.5
"""How many leaves a pickle may list for each of its bytes, beyond ``MIN_LEAVES``: every value a pickle writes
takes a byte or more (a memo reference two), so only a pickle that reaches one container by many paths (a list
of a thousand references to a list of a thousand values) lists more, and is refused before it exhausts memory."""
MIN_LEAVES = 1 << 18

Placer = Callable[[TensorMeta], Piece | None]
"""Where a tensor's elements lie in its file, or None where the graph's storages are not the file's own."""


def canonical(value: Any) -> Hashable:
    """``value`` in a form that is equal exactly when the values are: floats by their bits, objects by their
    class, arguments and state; a tensor that is not the file's own by what it is, not its bytes."""
    if isinstance(value, bool) or value is None or isinstance(value, (int, str, bytes)):
        return (type(value).__name__, value)
    if isinstance(value, float):
        return ("float", struct.pack("<d", value))
    if isinstance(value, complex):
        return ("complex", struct.pack("<dd", value.real, value.imag))
    if isinstance(value, GlobalRef):
        return ("global", value.qualname)
    if isinstance(value, StorageRef):
        return ("storage", value.dtype, value.numel)
    if isinstance(value, Reduced):
        return ("object", value.func.qualname, canonical(value.args), canonical(value.state))
    if isinstance(value, PickledObject):
        return ("object", value.qualname(), canonical(value.args), canonical(value.state))
    if isinstance(value, dict):
        return ("dict", tuple((canonical(key), canonical(item)) for key, item in value.items()))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(canonical(item) for item in value))
    if isinstance(value, (set, frozenset)):
        return (type(value).__name__, frozenset(canonical(item) for item in value))
    return ("other", type(value).__name__)


class _Walk:
    def __init__(self, placer: Placer | None, source: str, limit: int) -> None:
        self.placer = placer
        self.source = source
        self.limit = limit
        self.leaves: dict[LeafPath, Leaf] = {}
        self.storages: dict[str, list[LeafPath]] = {}
        self.walking: set[int] = set()

    def add(self, path: LeafPath, leaf: Leaf) -> None:
        if len(self.leaves) >= self.limit:
            reason = f"lists more than {self.limit} values to compare (a pickle that reaches its values by many paths)"
            raise InputError(reason, path=self.source)
        self.leaves.setdefault(path, leaf)

    def tensor(self, path: LeafPath, meta: TensorMeta) -> bool:
        piece = self.placer(meta) if self.placer is not None else None
        if piece is None:
            return False
        self.storages.setdefault(meta.storage, []).append(path)
        self.add(path, TensorLeaf(meta.dtype, meta.shape, meta.stride, (piece,)))
        return True

    def visit(self, node: Any, path: LeafPath) -> None:
        meta = tensor_meta(node)
        if meta is not None and self.tensor(path, meta):
            return
        if not isinstance(node, (dict, list, tuple)):
            self.add(path, ValueLeaf(canonical(node), shown(node)))
            return
        if not node:
            self.add(path, ValueLeaf((type(node).__name__, ()), shown(node)))
            return
        if id(node) in self.walking:
            self.add(path, ValueLeaf(("cycle",), "(a container that holds itself)"))
            return
        self.walking.add(id(node))
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, child in items:
            self.visit(child, (*path, path_part(key)))
        self.walking.discard(id(node))


def graph_leaves(
    root: Any, source: str, placer: Placer | None, pickled: int, prefix: LeafPath = ()
) -> dict[LeafPath, Leaf]:
    """Every leaf under ``root`` (unpickled from ``pickled`` bytes), its path beginning with ``prefix``; each tensor
    placed by ``placer`` (without one, a tensor is a value: what it is, not its bytes), with the others on its
    storage (``shares``)."""
    walk = _Walk(placer, source, min(MAX_LEAVES, MIN_LEAVES + int(pickled * LEAVES_PER_BYTE)))
    walk.visit(root, prefix)
    for paths in walk.storages.values():
        first = min(paths)
        for path in paths:
            leaf = walk.leaves[path]
            if isinstance(leaf, TensorLeaf) and leaf.shares is None:
                walk.leaves[path] = TensorLeaf(leaf.dtype, leaf.shape, leaf.stride, leaf.pieces, (first, len(paths)))
    return walk.leaves
