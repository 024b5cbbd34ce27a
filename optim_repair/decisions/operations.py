"""Renaming, dropping and adding parameters when the model changed: which parameters change, and how. Pure.

Applied in the order rename, drop, add, to the optimizer's inventory itself: what comes out is the optimizer
as the repaired copy will hold it, whose parameters without state (the added ones among them) the fill then
fills like any other.
"""

from __future__ import annotations

import importlib
import math
import re
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from optim_repair.decisions.optimizers import PARAM_SHAPED_KEYS
from optim_repair.errors import Remedy, RepairRefused, UsageError, shown
from optim_repair.records.inventory import OptimizerInventory, ParamGroup, ParamKey, TensorMeta, WeightMap
from optim_repair.records.repair_plan import ParamChange
from optim_repair.records.request import Operations


@dataclass(frozen=True)
class Applied:
    """An optimizer after the operations: its inventory as the copy will hold it, the renames and drops that
    take it there, and the model parameters it gains (which have no state yet), with their group."""

    optimizer: OptimizerInventory
    changes: tuple[ParamChange, ...]
    joined: dict[ParamKey, int]


_parser: Any = importlib.import_module("re._parser" if sys.version_info >= (3, 11) else "sre_parse")
"""The parser of Python's ``re`` (``sre_parse`` before 3.11), for the shape of a user's pattern."""

MAX_WAYS = 10**10
"""The most ways a user's pattern may give the matcher to try on all the names it is matched against (a few
seconds at worst). ``re`` backtracks without a bound (``(a+)+$`` tries about 2**n ways on a name of n characters
that ends otherwise), so a pattern is refused when its bound exceeds this; a common pattern's bound on a name is
the name's length or its square."""
_CAP = 1 << 100
"""Where a bound stops growing: far beyond ``MAX_WAYS``, and an ``int`` of a few words."""


def _product(*factors: int) -> int:
    return min(math.prod(factors), _CAP)


def _ways(items: Any, n: int) -> int:
    """An upper bound on the ways the backtracking matcher can try ``items`` (a parsed pattern) against n
    characters: each repeat multiplies by the counts it can try (n + 1 at most) and, where its body can itself
    match in several ways, by those ways for every repetition; an alternation adds its branches' ways."""
    total = 1
    for op, arg in items:
        kind = str(op)
        if kind in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            low, high, body = arg
            most, inner = max(min(high, n), low), _ways(body, n)
            power = _CAP if inner > 1 and most * math.log2(inner) >= _CAP.bit_length() else inner**most
            total = _product(total, most - low + 1, power)
        elif kind == "BRANCH":
            total = _product(total, sum(_ways(branch, n) for branch in arg[1]))
        elif kind in ("SUBPATTERN", "ASSERT", "ASSERT_NOT"):
            total = _product(total, _ways(arg[-1], n))
        elif kind == "ATOMIC_GROUP":
            total = _product(total, _ways(arg, n))
        elif kind == "GROUPREF_EXISTS":
            total = _product(total, _ways(arg[1], n) + (_ways(arg[2], n) if arg[2] else 1))
    return total


def _search_ways(parsed: Any, n: int) -> int:
    """An upper bound on the ways a search (or a ``sub``) with the ``parsed`` pattern tries on n characters: its
    ways from each place it can start, or from the start alone when it is anchored there."""
    items = list(parsed)
    first = str(items[0][1]) if items and str(items[0][0]) == "AT" else ""
    anchored = first == "AT_BEGINNING_STRING" or (first == "AT_BEGINNING" and not parsed.state.flags & re.MULTILINE)
    ways = _ways(items, n)
    return ways + n if anchored else _product(n + 1, ways)


def _pattern(text: str, option: str, names: Iterable[str]) -> re.Pattern[str]:
    """``text`` compiled, refused when matching it against ``names`` could take unbounded work."""
    try:
        pattern = re.compile(text)
    except re.error as exc:
        raise UsageError(f"{{argument}} {shown(text)} is not a regular expression ({exc})", argument=option) from exc
    lengths, parsed = Counter(map(len, names)), _parser.parse(text)
    if sum(count * _search_ways(parsed, n) for n, count in lengths.items()) > MAX_WAYS:
        raise UsageError(
            f"{{argument}} {shown(text)} could make the matcher try more than {MAX_WAYS:,} ways on the "
            f"{lengths.total()} parameter names, of up to {max(lengths)} characters (a repeat inside a repeat, or "
            "many repeats in a row): rewrite it without them",
            argument=option,
        )
    return pattern


def _renamed(names: Sequence[str], renames: Sequence[tuple[str, str]], where: str) -> dict[str, str]:
    current = {name: name for name in names}
    for old, new in renames:
        pattern = _pattern(old, "rename", current.values())
        if not any(pattern.search(name) for name in current.values()):
            raise RepairRefused(f"{where}: the rename {shown(f'{old}={new}')} matches no parameter name")
        try:
            current = {name: pattern.sub(new, now) for name, now in current.items()}
        except (re.error, IndexError) as exc:
            raise UsageError(f"{{argument}} {shown(new)} is no valid replacement ({exc})", argument="rename") from exc
    seen: dict[str, str] = {}
    for name, now in current.items():
        if now in seen:
            merged = f"{shown(seen[now])} and {shown(name)}"
            raise RepairRefused(f"{where}: the renames give {merged} one name, {shown(now)}")
        seen[now] = name
    return current


def _model_names(model: Sequence[WeightMap], where: str, option: str) -> list[str]:
    if not model:
        raise RepairRefused(
            f"{where}: {option} needs the model, and none was found beside the optimizer",
            remedy=Remedy("model", "PATH", placeholder=True, note=" with the model's weights"),
        )
    return list(dict.fromkeys(name for weight_map in model for name, _ in weight_map.tensors))


def apply_operations(
    optimizer: OptimizerInventory, operations: Operations, model: Sequence[WeightMap], where: str
) -> Applied:
    """``optimizer`` renamed, pruned and extended as ``operations`` ask; refused with the reason when they cannot
    be applied (a rename that matches nothing or merges two names; what indices cannot say)."""
    if optimizer.key_style == "index":
        return _by_index(optimizer, operations, model, where)
    names = [str(param) for param in dict.fromkeys(optimizer.params)]
    renamed = _renamed(names, operations.renames, where)
    dropped: set[str] = set()
    for text in operations.drops:
        pattern = _pattern(text, "drop", renamed.values())
        matched = {name for name, now in renamed.items() if pattern.search(now)}
        if not matched:
            raise RepairRefused(f"{where}: the drop pattern {shown(text)} matches no parameter name")
        dropped |= matched
    if operations.drop_not_in_model:
        known = set(_model_names(model, where, "dropping the parameters the model lacks"))
        dropped |= {name for name, now in renamed.items() if now not in known}
    changes = tuple(
        ParamChange(optimizer.file, optimizer.location, optimizer.address, name, None if name in dropped else now)
        for name, now in renamed.items()
        if name in dropped or now != name
    )
    joined: dict[ParamKey, int] = {}
    if operations.add_from_model:
        group = _target_group(optimizer, operations.to_group, where)
        listed = {now for name, now in renamed.items() if name not in dropped}
        model_names = _model_names(model, where, "adding the model's parameters")
        joined = {name: group for name in model_names if name not in listed}
    kept = {name: now for name, now in renamed.items() if name not in dropped}
    if renamed and not kept and not joined:
        raise RepairRefused(f"{where}: the drops leave the optimizer no parameter; nothing would be left to resume")
    groups = tuple(
        ParamGroup(
            (
                *(kept[str(param)] for param in group.params if str(param) in kept),
                *(name for name, index in joined.items() if index == number),
            ),
            group.options,
        )
        for number, group in enumerate(optimizer.groups)
    )
    entries = tuple(
        replace(entry, param=kept[str(entry.param)]) if str(entry.param) in kept else entry
        for entry in optimizer.entries
        if str(entry.param) in kept or str(entry.param) not in renamed  # an orphan entry is kept as it is
    )
    return Applied(replace(optimizer, groups=groups, entries=entries), changes, joined)


def _by_index(optimizer: OptimizerInventory, operations: Operations, model: Sequence[WeightMap], where: str) -> Applied:
    """An index-keyed optimizer (``optimizer.state_dict()``) names no parameter: renames and drops, which pick
    parameters by name, cannot apply. Adding the model's parameters can, by count: the model's parameters beyond
    the optimizer's join a group as the next indices, once the shapes of the optimizer's moments are found among
    the model's; ``optimizer.load_state_dict`` then maps them in the order the resuming optimizer lists them."""
    if operations.renames or operations.drops or operations.drop_not_in_model:
        raise RepairRefused(
            f"{where}: this optimizer is keyed by indices (optimizer.state_dict()), which name no parameter, so "
            "which index a name or the model's parameter is cannot be told from the checkpoint: renames and drops "
            "need parameter names"
        )
    group = _target_group(optimizer, operations.to_group, where)
    names = _model_names(model, where, "adding the model's parameters")
    shapes = {name: meta.shape for weight_map in model for name, meta in weight_map.tensors}
    listed = list(dict.fromkeys(optimizer.params))
    moments: Counter[tuple[int, ...]] = Counter()
    for entry in optimizer.entries:  # one moment per entry: the shape of its parameter
        shaped = [v.shape for k, v in entry.values or () if k in PARAM_SHAPED_KEYS and isinstance(v, TensorMeta)]
        if shaped:
            moments[shaped[0]] += 1
    available = Counter(shapes[name] for name in names)
    if any(count > available[shape] for shape, count in moments.items()):
        raise RepairRefused(f"{where}: the model's shapes do not hold this optimizer's moments: it is not its model")
    extra = len(names) - len(listed)
    if extra <= 0:
        raise RepairRefused(f"{where}: the model has no parameter beyond the optimizer's {len(listed)}: nothing to add")
    first = max((p for p in listed if isinstance(p, int)), default=-1) + 1
    joined: dict[ParamKey, int] = {index: group for index in range(first, first + extra)}
    groups = tuple(
        ParamGroup((*g.params, *(p for p, n in joined.items() if n == number)), g.options)
        for number, g in enumerate(optimizer.groups)
    )
    return Applied(replace(optimizer, groups=groups), (), joined)


def _target_group(optimizer: OptimizerInventory, to_group: int | None, where: str) -> int:
    if to_group is None:
        if len(optimizer.groups) == 1:
            return 0
        raise UsageError(
            f"{where}: the optimizer has {len(optimizer.groups)} param groups; {{argument}} says which one the "
            "added parameters join",
            argument="to_group",
        )
    if not 0 <= to_group < len(optimizer.groups):
        raise UsageError(
            f"{where}: {{argument}} {to_group} is not a param group (0 to {len(optimizer.groups) - 1})",
            argument="to_group",
        )
    return to_group
