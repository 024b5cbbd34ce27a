"""The plan for one DCP checkpoint, finished before anything is written: the new entries and their keys.

As torch's DCP planner finishes a ``SavePlan`` before storage writes a byte, ``plan_dcp`` turns a repair
plan's additions, renames and drops into the metadata keys of each optimizer's layout (nested or
flattened, ``records.keys``), and refuses here what cannot be done: no optimizer at an address, an empty
entry (DCP stores no empty mappings), a key that exists, a ``.metadata`` pickle no repair can extend, an
addition to a checkpoint holding tensor-subclass state (``DcpTensor.compact``).
The writer writes what it holds; the verifier proves the copy against it and the original.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from optim_repair.errors import InputError, RepairRefused, shown
from optim_repair.formats.dcp.layout import find_optimizers, longest_name
from optim_repair.formats.dcp.metadata import DcpMetadata, DcpTensor, KeyPath
from optim_repair.records import keys
from optim_repair.records.inventory import ParamKey
from optim_repair.records.keys import dotted
from optim_repair.records.repair_plan import AddedValue, Addition, GroupOption, ParamChange


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
    without_strides: bool = False
    """Whether the copy's ``TensorProperties`` drop torch 2.15's ``strides``, for a torch before it to read."""

    @property
    def rewrites_metadata(self) -> bool:
        """Whether the copy gets a new ``.metadata`` (else the original's is copied as it is)."""
        return bool(self.entries) or self.rekeyed.rebuilds_tables or self.without_strides


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
    renamed: dict[str, str | None] = {}
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
            if optimizer.layout == "nested" and slot.section == keys.PARAM_GROUPS:
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
                if slot.section == keys.PARAM_GROUPS and addition.like is not None and now == addition.like:
                    flat = f"{keys.PARAM_GROUPS}.{addition.param}{slot.flat[len(str(name)) :]}"
                    alias: KeyPath = (*slot.root, flat, *slot.rest)
                    aliases[dotted(alias)] = (slot.key, alias)
            if name not in mapping:
                continue
            new = mapping[name]
            if new is None:
                renamed[slot.key] = None
                continue
            if optimizer.layout == "nested":
                path: KeyPath = (*slot.root, slot.section, new, *slot.rest[1:])
            else:
                path = (*slot.root, f"{slot.section}.{new}{slot.flat[len(str(name)) :]}", *slot.rest)
            renamed[slot.key] = dotted(path)
            paths[dotted(path)] = path
    return Rekeyed(renamed, paths, params, aliases)


def plan_entries(meta: DcpMetadata, additions: Sequence[Addition], source: str) -> PlannedEntries:
    """The new metadata entries that hold ``additions``, in the layout of each optimizer they extend."""
    layouts = {optimizer.root: optimizer.layout for optimizer in find_optimizers(meta, source)}
    compact = next((key for key, item in meta.items.items() if isinstance(item, DcpTensor) and item.compact), None)
    if additions and compact is not None:
        raise RepairRefused(
            f"{compact} is stored in fewer bytes than its elements take: a tensor subclass in its own encoding "
            "(torchao's quantized optimizer state); adding state to a checkpoint that holds one is not supported "
            "(the subclass's fresh state cannot be written, and no stored bytes back its size)",
            path=source,
        )
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
            key = dotted((*addition.address, keys.STATE, addition.param, state_key))
            path: KeyPath = (
                (*addition.address, keys.STATE, addition.param, state_key)
                if layout == "nested"
                else (*addition.address, keys.flat_key(keys.STATE, addition.param, state_key))
            )
            if key in taken:
                raise RepairRefused(f"{key} already exists; refusing to overwrite it", path=source)
            taken.add(key)
            entries.append(NewEntry(key, path, value))
    return PlannedEntries(meta, tuple(entries))


def _option_entries(meta: DcpMetadata, options: Sequence[GroupOption], source: str) -> list[NewEntry]:
    """Each param-group option to add as a new bytes entry beside its group's others, keyed and pathed as they
    are (``optim.param_groups.0.decoupled_weight_decay`` beside ``optim.param_groups.0.lr``)."""
    entries = []
    for option in options:
        prefix = dotted((*option.address, keys.PARAM_GROUPS, option.group))
        sibling = next(
            (key for key in meta.items if key.startswith(f"{prefix}.") and "." not in key[len(prefix) + 1 :]), None
        )
        if sibling is None:
            raise RepairRefused(f"holds no entries of param group {prefix} to add {option.key} beside", path=source)
        key = f"{prefix}.{option.key}"
        if key in meta.items:
            raise RepairRefused(f"{key} already exists; refusing to overwrite it", path=source)
        path = meta.path_of(sibling)
        entries.append(NewEntry(key, (key,) if path == (sibling,) else (*path[:-1], option.key), option.value))
    return entries


def plan_dcp(
    meta: DcpMetadata,
    source: str,
    additions: Sequence[Addition],
    changes: Sequence[ParamChange] = (),
    groups: Mapping[KeyPath, Sequence[Sequence[ParamKey]]] | None = None,
    options: Sequence[GroupOption] = (),
    older_form: bool = False,
) -> PlannedEntries:
    """The whole plan for one DCP checkpoint: ``additions`` as new entries, the param-group ``options`` too, and
    the keys ``changes`` and joining parameters rename, drop or add. ``groups`` holds each changed optimizer's
    ``params`` lists, by address, as reading found them. ``older_form``: the copy's ``.metadata`` is written in the
    form a torch before 2.15 reads, where torch 2.15 wrote the original. Raises ``RepairRefused`` (or
    ``InputError`` for a ``.metadata`` no repair can extend) for what the writer cannot do."""
    planned = plan_entries(meta, additions, source)
    if options:
        planned = PlannedEntries(meta, (*planned.entries, *_option_entries(meta, options, source)))
    joined = [addition for addition in additions if addition.group is not None]
    if changes or joined:
        planned = PlannedEntries(meta, planned.entries, rekey(meta, changes, groups or {}, source, joined))
    if older_form and meta.pickle is not None and meta.pickle.property_fields > 5:
        planned = replace(planned, without_strides=True)
    if planned.rewrites_metadata and meta.pickle is None:
        raise InputError(
            "its pickle does not keep the metadata tables where a repair can extend them "
            "(it was not written by torch's DCP writer)",
            path=source,
        )
    return planned
