"""An optimizer state dict of a torch pickle graph with renames, drops and additions applied: new dicts, values shared.

The original graph is never changed. The new dicts hold the same value objects (tensors, hyperparameters)
under the new names, so that they pickle exactly as before; only the containers on the way to an edited
optimizer, and the dicts and ``params`` lists that name its parameters, are new.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from optim_repair.records import keys
from optim_repair.records.repair_plan import Addition, ParamChange


def changed_optimizer(optimizer: dict[Any, Any], changes: Sequence[ParamChange]) -> dict[Any, Any]:
    """A copy of the optimizer state dict ``optimizer`` (nested, or flattened) with ``changes`` applied: renamed
    parameters keep their place, dropped ones leave ``state`` and every group. Its ``state`` dict, groups and
    ``params`` lists are new, which additions may extend without touching the original."""
    mapping = {change.old: change.new for change in changes}
    if keys.is_nested(optimizer):
        state = optimizer[keys.STATE]
        edited = optimizer.copy()
        edited[keys.STATE] = _refilled(state, ((mapping.get(k, k), v) for k, v in state.items()))
        groups = []
        for group in optimizer[keys.PARAM_GROUPS]:
            copy = group.copy()
            copy["params"] = [mapping.get(p, p) for p in group["params"] if mapping.get(p, p) is not None]
            groups.append(copy)
        edited[keys.PARAM_GROUPS] = groups
        return edited
    return _refilled(optimizer, ((keys.renamed_flat(key, mapping), value) for key, value in optimizer.items()))


def _refilled(mapping: dict[Any, Any], items: Iterable[tuple[Any, Any]]) -> dict[Any, Any]:
    """A new dict of ``mapping``'s own type holding ``items``, but those whose key is None (dropped)."""
    new = mapping.copy()
    new.clear()
    new.update((key, value) for key, value in items if key is not None)
    return new


def with_entry(optimizer: dict[Any, Any], addition: Addition, values: Sequence[Any]) -> None:
    """Put ``addition``'s entry, holding ``values``, into ``optimizer``, a copy ``changed_optimizer`` made.

    Nested: ``state`` gets the parameter's entry (in place of a replaced one). Flattened: one
    ``state.<name>.<key>`` key per value; a replacement removes the keys it does not set, and a parameter
    joining a group repeats its group member's hyperparameters. A joining parameter also ends its
    group's ``params``.
    """
    if keys.is_nested(optimizer):
        optimizer[keys.STATE][addition.param] = dict(zip(addition.keys, values, strict=True))
        if addition.group is not None:
            optimizer[keys.PARAM_GROUPS][addition.group]["params"].append(addition.param)
        return
    new = [keys.flat_key(keys.STATE, addition.param, key) for key in addition.keys]
    if addition.replaces:
        for key in [k for k in optimizer if keys.leaf_of(k, keys.STATE, addition.param) is not None]:
            if key not in new:
                del optimizer[key]
    optimizer.update(zip(new, values, strict=True))
    if addition.like is not None:
        optimizer.update(_hyperparameters_of(optimizer, addition.like, addition.param))


def _hyperparameters_of(optimizer: Mapping[str, Any], like: object, param: object) -> dict[str, Any]:
    """The ``param_groups.<like>.<hp>`` values of a flattened optimizer, keyed for ``param`` instead."""
    found = {}
    for key, value in optimizer.items():
        leaf = keys.leaf_of(key, keys.PARAM_GROUPS, like)
        if leaf is not None:
            found[keys.flat_key(keys.PARAM_GROUPS, param, leaf)] = value
    return found


def put(root: Any, address: tuple[Any, ...], value: Any) -> Any:
    """A new root holding ``value`` at ``address``: each container on the way is copied (a tuple rebuilt),
    the others shared; ``root`` itself is never changed."""
    if not address:
        return value
    head, rest = address[0], address[1:]
    child = put(root[head], rest, value)
    if isinstance(root, tuple):
        return (*root[:head], child, *root[head + 1 :])
    copy = root.copy()
    copy[head] = child
    return copy
