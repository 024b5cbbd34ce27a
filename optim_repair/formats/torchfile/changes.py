"""Renaming and dropping parameters in an optimizer state dict of a torch pickle graph: a new dict, values shared.

The new dict holds the same value objects (tensors, hyperparameters) under the new names, so that they pickle
exactly as before; only the dicts and ``params`` lists that name parameters are new.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from optim_repair.records.repair_plan import ParamChange

_FLAT_SECTIONS = ("state.", "param_groups.")


def changed_optimizer(optimizer: dict[Any, Any], changes: Sequence[ParamChange]) -> dict[Any, Any]:
    """A copy of the optimizer state dict ``optimizer`` (nested, or flattened) with ``changes`` applied: renamed
    parameters keep their place, dropped ones leave ``state`` and every group. Its ``params`` lists are new
    lists, which additions may extend without touching the original."""
    mapping = {change.old: change.new for change in changes}
    if "state" in optimizer and "param_groups" in optimizer:
        state = {mapping.get(k, k): v for k, v in optimizer["state"].items() if mapping.get(k, k) is not None}
        groups = [
            {**group, "params": [mapping.get(p, p) for p in group["params"] if mapping.get(p, p) is not None]}
            for group in optimizer["param_groups"]
        ]
        return {**optimizer, "state": state, "param_groups": groups}
    edited = {}
    for key, value in optimizer.items():
        section = next(s for s in _FLAT_SECTIONS if key.startswith(s))
        name, _, leaf = key[len(section) :].rpartition(".")  # a state key or hyperparameter has no dot
        new = mapping.get(name, name)
        if new is not None:
            edited[f"{section}{new}.{leaf}"] = value
    return edited


Undo = list[tuple[Any, Any, Any]]
"""The containers ``put`` changed in place, with the key and the child each held before."""


def put(root: Any, address: tuple[Any, ...], value: Any, undo: Undo) -> Any:
    """Put ``value`` at ``address`` in the graph ``root``; return the (possibly new) root. A tuple on the way is
    rebuilt; a dict or list is changed in place, and ``undo`` records what it held."""
    if not address:
        return value
    head, rest = address[0], address[1:]
    child = put(root[head], rest, value, undo)
    if isinstance(root, tuple):
        return (*root[:head], child, *root[head + 1 :])
    undo.append((root, head, root[head]))
    root[head] = child
    return root


def restore(undo: Undo) -> None:
    """Undo what ``put`` changed in place, latest first."""
    for container, key, child in reversed(undo):
        container[key] = child
