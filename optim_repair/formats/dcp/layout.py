"""Where optimizers and model weights sit among a DCP checkpoint's keys: the nested and flattened layouts.

Nested (``get_optimizer_state_dict``): ``optim.state.<fqn>.<key>`` and ``optim.param_groups.<i>.<hp>``.
Flattened (``flatten_optimizer_state_dict=True``, torchtitan): ``optimizer.state.<fqn>.<key>`` and
``optimizer.param_groups.<fqn>.<hp>``. Parameter names contain dots, so keys are split by the
metadata's ``planner_data`` (the original key paths), never by guessing.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from optim_repair.errors import InputError, RepairRefused, shown
from optim_repair.formats.dcp.metadata import DcpMetadata, DcpTensor, KeyPath
from optim_repair.records.inventory import ParamKey, TensorMeta
from optim_repair.records.repair_plan import AddedValue, Addition, ParamChange

Layout = Literal["nested", "flattened"]
_SECTIONS = ("state", "param_groups")


@dataclass(frozen=True)
class OptimizerSlot:
    """One metadata key that belongs to an optimizer's ``state`` or ``param_groups``."""

    key: str
    root: KeyPath
    section: str
    layout: Layout
    rest: KeyPath
    """Nested: the path after the section. Flattened: the path after the flattened element."""
    flat: str = ""
    """Flattened: the flattened element without its section (``blocks.0.w.exp_avg``)."""


def _optimizer_slot(key: str, path: KeyPath) -> OptimizerSlot | None:
    for i, part in enumerate(path):
        if part in _SECTIONS and len(path) - i >= 3:
            return OptimizerSlot(key, path[:i], str(part), "nested", path[i + 1 :])
        if isinstance(part, str):
            for section in _SECTIONS:
                if part.startswith(f"{section}.") and len(part) > len(section) + 1:
                    return OptimizerSlot(key, path[:i], section, "flattened", path[i + 1 :], part[len(section) + 1 :])
    return None


def dotted(parts: Sequence[ParamKey]) -> str:
    """A key path as DCP flattens it into a metadata key: its parts joined by dots."""
    return ".".join(str(part) for part in parts)


@dataclass(frozen=True)
class DcpOptimizer:
    """An optimizer among a checkpoint's keys: where its state dict sits, its layout and its keys."""

    root: KeyPath
    layout: Layout
    slots: tuple[OptimizerSlot, ...]

    @property
    def location(self) -> str:
        return dotted(self.root)


def find_optimizers(meta: DcpMetadata, source: str) -> list[DcpOptimizer]:
    """Every optimizer state dict among the keys: a root with ``param_groups`` keys under it."""
    by_root: dict[KeyPath, list[OptimizerSlot]] = {}
    for key in meta.items:
        slot = _optimizer_slot(key, meta.path_of(key))
        if slot is not None:
            by_root.setdefault(slot.root, []).append(slot)
    found = []
    for root, slots in by_root.items():
        if not any(slot.section == "param_groups" for slot in slots):
            continue
        layouts = {slot.layout for slot in slots}
        if len(layouts) > 1:
            raise InputError(f"the optimizer at {dotted(root)} mixes nested and flattened keys", path=source)
        found.append(DcpOptimizer(root, layouts.pop(), tuple(slots)))
    return found


def model_weights(meta: DcpMetadata, optimizers: Sequence[DcpOptimizer]) -> dict[KeyPath, dict[str, TensorMeta]]:
    """Every tensor outside the optimizers, by the path of keys that holds it and its name: the model's
    weights wherever they sit, under ``model`` (UniRL), under any other key, or at the top level
    (torchtitan saves ``tok_embeddings.weight`` beside ``optimizer.*``)."""
    taken = {slot.key for optimizer in optimizers for slot in optimizer.slots}
    found: dict[KeyPath, dict[str, TensorMeta]] = {}
    for key, item in meta.items.items():
        path = meta.path_of(key)
        if isinstance(item, DcpTensor) and key not in taken and path and isinstance(path[-1], str):
            found.setdefault(path[:-1], {})[path[-1]] = item.meta(key)
    return found


@dataclass(frozen=True)
class NewEntry:
    """One planned value as a new metadata entry: its flattened key and its key path."""

    key: str
    path: KeyPath
    value: AddedValue


@dataclass(frozen=True)
class Rekeyed:
    """What renames and drops do to a checkpoint's metadata keys: each changed key's new key (None: dropped),
    the key paths of the new keys, and the ``params`` lists (nested layout) that are written anew."""

    keys: Mapping[str, str | None] = field(default_factory=dict)
    paths: Mapping[str, KeyPath] = field(default_factory=dict)
    params: Mapping[str, list[ParamKey]] = field(default_factory=dict)
    aliases: Mapping[str, tuple[str, KeyPath]] = field(default_factory=dict)
    """New keys that hold an existing entry's bytes, by the key they share them with, and their key paths: the
    hyperparameters a flattened layout repeats for a parameter that joins a group."""

    @property
    def rebuilds_tables(self) -> bool:
        """Whether the metadata's tables change other than by new entries (rebuilt, not extended)."""
        return bool(self.keys or self.params or self.aliases)

    def new_key(self, key: str) -> str | None:
        return self.keys.get(key, key)


@dataclass(frozen=True)
class PlannedEntries:
    """A plan's additions to one DCP checkpoint as new metadata entries, computed once for writer and verifier."""

    original: DcpMetadata
    entries: tuple[NewEntry, ...]
    rekeyed: Rekeyed = field(default_factory=Rekeyed)

    @property
    def rewrites_metadata(self) -> bool:
        """Whether the copy gets a new ``.metadata`` (else the original's is copied as it is)."""
        return bool(self.entries) or self.rekeyed.rebuilds_tables


def longest_name(flat: str, names: Collection[ParamKey]) -> str | None:
    """The longest parameter name ``flat`` (a flattened element, ``<name>.<key>``) starts with, followed by a dot."""
    end = len(flat)
    while (end := flat.rfind(".", 0, end)) > 0:
        if flat[:end] in names:
            return flat[:end]
    return None


def rekey(
    meta: DcpMetadata,
    changes: Sequence[ParamChange],
    groups: Mapping[KeyPath, Sequence[Sequence[ParamKey]]],
    source: str,
    joined: Sequence[Addition] = (),
) -> Rekeyed:
    """The metadata keys ``changes`` rename or drop, in each optimizer's layout, and the ``params`` lists they and
    the parameters that ``joined`` a group change; ``groups`` holds each changed optimizer's ``params`` lists, by
    its address, as reading found them."""
    keys: dict[str, str | None] = {}
    paths: dict[str, KeyPath] = {}
    params: dict[str, list[ParamKey]] = {}
    aliases: dict[str, tuple[str, KeyPath]] = {}
    for optimizer in find_optimizers(meta, source):
        mapping = {change.old: change.new for change in changes if change.address == optimizer.root}
        joining = [addition for addition in joined if addition.address == optimizer.root]
        if not mapping and not joining:
            continue
        lists = groups[optimizer.root]
        names = {param for group in lists for param in group}
        for slot in optimizer.slots:
            if optimizer.layout == "nested" and slot.section == "param_groups":
                index = slot.rest[0]
                if dotted(slot.rest[1:]) == "params" and isinstance(index, int) and index < len(lists):
                    kept = [new for new in (mapping.get(p, p) for p in lists[index]) if new is not None]
                    kept += [addition.param for addition in joining if addition.group == index]
                    if kept != list(lists[index]):
                        params[slot.key] = kept
                continue
            name = slot.rest[0] if optimizer.layout == "nested" else longest_name(slot.flat, names)
            if name is None:
                continue
            now = mapping.get(name, name)
            for addition in joining:  # flattened: a joining parameter repeats its group member's hyperparameters
                if slot.section == "param_groups" and addition.like is not None and now == addition.like:
                    flat = f"param_groups.{addition.param}{slot.flat[len(str(name)) :]}"
                    alias: KeyPath = (*slot.root, flat, *slot.rest)
                    aliases[dotted(alias)] = (slot.key, alias)
            if name not in mapping:
                continue
            new = mapping[name]
            if new is None:
                keys[slot.key] = None
                continue
            if optimizer.layout == "nested":
                path: KeyPath = (*slot.root, slot.section, new, *slot.rest[1:])
            else:
                path = (*slot.root, f"{slot.section}.{new}{slot.flat[len(str(name)) :]}", *slot.rest)
            keys[slot.key] = dotted(path)
            paths[dotted(path)] = path
    return Rekeyed(keys, paths, params, aliases)


def plan_entries(meta: DcpMetadata, additions: Sequence[Addition], source: str) -> PlannedEntries:
    """The new metadata entries that hold ``additions``, in the layout of each optimizer they extend."""
    layouts = {optimizer.root: optimizer.layout for optimizer in find_optimizers(meta, source)}
    entries: list[NewEntry] = []
    taken = set(meta.items)
    for addition in additions:
        layout = layouts.get(addition.address)
        if layout is None:
            raise RepairRefused(f"holds no optimizer at {shown(addition.location)}", path=source)
        if not addition.state:
            raise RepairRefused(
                f"cannot add an empty state entry for {shown(addition.param)}: "
                "DCP stores no empty mappings; use the fresh fill",
                path=source,
            )
        for state_key, value in addition.state:
            key = dotted((*addition.address, "state", addition.param, state_key))
            path: KeyPath = (
                (*addition.address, "state", addition.param, state_key)
                if layout == "nested"
                else (*addition.address, f"state.{addition.param}.{state_key}")
            )
            if key in taken:
                raise RepairRefused(f"{key} already exists; refusing to overwrite it", path=source)
            taken.add(key)
            entries.append(NewEntry(key, path, value))
    return PlannedEntries(meta, tuple(entries))
