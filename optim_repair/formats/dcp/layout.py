"""Where optimizers and model weights sit among a DCP checkpoint's keys: the nested and flattened layouts.

Nested (``get_optimizer_state_dict``): ``optim.state.<fqn>.<key>`` and ``optim.param_groups.<i>.<hp>``.
Flattened (``flatten_optimizer_state_dict=True``, torchtitan): ``optimizer.state.<fqn>.<key>`` and
``optimizer.param_groups.<fqn>.<hp>``. Parameter names contain dots, so keys are split by the
metadata's ``planner_data`` (the original key paths), never by guessing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from optim_repair.errors import InputError, RepairRefused, shown
from optim_repair.formats.dcp.metadata import DcpMetadata, DcpTensor, KeyPath
from optim_repair.inventory import ParamKey, TensorMeta
from optim_repair.repair_plan import AddedValue, Addition

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
class PlannedEntries:
    """A plan's additions to one DCP checkpoint as new metadata entries, computed once for writer and verifier."""

    original: DcpMetadata
    entries: tuple[NewEntry, ...]


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
