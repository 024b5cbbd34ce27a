"""Where optimizers and model weights sit among a DCP checkpoint's keys: the nested and flattened layouts.

Nested (``get_optimizer_state_dict``): ``optim.state.<fqn>.<key>`` and ``optim.param_groups.<i>.<hp>``.
Flattened (``flatten_optimizer_state_dict=True``, torchtitan): ``optimizer.state.<fqn>.<key>`` and
``optimizer.param_groups.<fqn>.<hp>``. Parameter names contain dots, so keys are split by the
metadata's ``planner_data`` (the original key paths), never by guessing.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal

from optim_repair.errors import InputError
from optim_repair.formats.dcp.metadata import DcpMetadata, DcpTensor, KeyPath
from optim_repair.records import keys
from optim_repair.records.inventory import ParamKey, TensorMeta
from optim_repair.records.keys import dotted

Layout = Literal["nested", "flattened"]


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
        if part in keys.SECTIONS and len(path) - i >= 3:
            return OptimizerSlot(key, path[:i], str(part), "nested", path[i + 1 :])
        if isinstance(part, str):
            for section in keys.SECTIONS:
                if part.startswith(f"{section}.") and len(part) > len(section) + 1:
                    return OptimizerSlot(key, path[:i], section, "flattened", path[i + 1 :], part[len(section) + 1 :])
    return None


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


def longest_name(flat: str, names: Collection[ParamKey]) -> str | None:
    """The longest parameter name ``flat`` (a flattened element, ``<name>.<key>``) starts with, followed by a dot."""
    end = len(flat)
    while (end := flat.rfind(".", 0, end)) > 0:
        if flat[:end] in names:
            return flat[:end]
    return None
