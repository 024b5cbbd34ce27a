"""The DCP checkpoint's adapter: its plan finished as metadata keys, written, and proven from disk.

A repair writes one new shard and a new ``.metadata``; every other shard is copied as it is. A checkpoint saved
without collectives has a metadata file a rank, each that rank's own view: each view is planned on its own, its
additions addressed under its name, and gets its own new shard and metadata file.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

from optim_repair.formats.dcp import METADATA_FILE, PlannedEntries, plan_dcp, read_metadata, view_key
from optim_repair.formats.dcp.metadata import display_path
from optim_repair.formats.dcp.verifier import verify_views
from optim_repair.formats.dcp.writer import write_planned_dcp
from optim_repair.formats.planned import Parsed, PlannedFile
from optim_repair.progress import Meter
from optim_repair.records.inventory import FileInventory, ParamKey
from optim_repair.records.repair_plan import Addition, FreshTensor, GroupOption, ParamChange, RepairPlan
from optim_repair.records.verification import READ_EVERYTHING, HolderProof, Verification


@dataclass(frozen=True)
class PlannedDcp:
    """A DCP checkpoint: its shards copied, and for each metadata file (``views``: its name and its plan) one new
    shard and a new metadata file where the plan changes it."""

    views: tuple[tuple[str, PlannedEntries], ...]

    @property
    def changes_anything(self) -> bool:
        return any(planned.rewrites_metadata for _, planned in self.views)

    def replaces(self, member: str) -> bool:
        return any(member == name and planned.rewrites_metadata for name, planned in self.views)

    def added_bytes(self) -> int:
        return sum(
            entry.value.nbytes
            for _, planned in self.views
            for entry in planned.entries
            if isinstance(entry.value, FreshTensor)
        )

    def write_views(self, src: Path, dest: Path, taken: Callable[[str], bool] | None = None) -> None:
        """Write each view's new shard and metadata file into ``dest`` (``taken``: the names of the checkpoint)."""
        for name, planned in self.views:
            write_planned_dcp(src, planned, dest, taken=taken, name=name)

    def verify_views(self, src: Path, dest: Path, holder: HolderProof = READ_EVERYTHING) -> Verification:
        return verify_views(src, dest, self.views, holder=holder)

    def write(self, src: Path, dest: Path, *, meter: Meter) -> None:
        dest.mkdir(exist_ok=True)
        self.write_views(src, dest)
        for _, planned in self.views:  # written in place of the original's, which the progress counts as read
            if planned.rewrites_metadata and planned.original.pickle is not None:
                meter.writing(len(planned.original.pickle.data))

    def verify(self, src: Path, dest: Path, meter: Meter) -> Verification:
        proven = self.verify_views(src, dest)
        meter.verifying(proven.bytes)
        return proven


def _under(view: str, address: tuple[ParamKey, ...]) -> tuple[ParamKey, ...] | None:
    """An address inside the view ``view``, or None for another view's."""
    return address[1:] if address[:1] == (view,) else None


_Addressed = TypeVar("_Addressed", Addition, ParamChange, GroupOption)


def _inside(items: Sequence[_Addressed], view: str | None) -> list[_Addressed]:
    """The items addressed inside ``view`` (None: the checkpoint has one view, every item is its), as it
    addresses them."""
    if view is None:
        return list(items)
    return [replace(item, address=inner) for item in items if (inner := _under(view, item.address)) is not None]


def _plan_view(path: Path, file: FileInventory, plan: RepairPlan, parsed: Parsed, name: str) -> PlannedEntries:
    """The plan of one metadata file: the plan's additions, changes and options at its optimizers' addresses
    (for a view, those under its name, the name taken off)."""
    meta = parsed.dcp.get(view_key(file.file, name)) or read_metadata(path, str(path), name=name)
    source = display_path(str(path), name)
    view = name if file.views else None
    groups = {
        address: [group.params for group in optimizer.groups]
        for optimizer in file.optimizers
        if (address := optimizer.address if view is None else _under(view, optimizer.address)) is not None
    }
    return plan_dcp(
        meta,
        source,
        _inside(plan.for_file(file.file), view),
        _inside(plan.changes_for(file.file), view),
        groups,
        _inside(plan.options_for(file.file), view),
        older_form=file.file in plan.older_forms,
    )


def plan_file(path: Path, file: FileInventory, plan: RepairPlan, parsed: Parsed) -> PlannedFile:
    names = file.views or (METADATA_FILE,)
    return PlannedDcp(tuple((name, _plan_view(path, file, plan, parsed, name)) for name in names))
