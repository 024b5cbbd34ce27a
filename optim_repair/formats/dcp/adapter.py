"""The DCP checkpoint's adapter: its plan finished as metadata keys, written, and proven from disk.

A repair writes one new shard and a new ``.metadata``; every other shard is copied as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from optim_repair.formats.dcp import METADATA_FILE, PlannedEntries, plan_dcp, read_metadata
from optim_repair.formats.dcp.metadata import display_path
from optim_repair.formats.dcp.verifier import verify_planned_dcp
from optim_repair.formats.dcp.writer import write_planned_dcp
from optim_repair.formats.planned import Parsed, PlannedFile
from optim_repair.progress import Meter
from optim_repair.records.inventory import FileInventory
from optim_repair.records.repair_plan import FreshTensor, RepairPlan
from optim_repair.records.verification import Verification


@dataclass(frozen=True)
class PlannedDcp:
    """A DCP checkpoint: its shards copied, one new shard and a new ``.metadata`` when the plan changes it."""

    planned: PlannedEntries

    @property
    def changes_anything(self) -> bool:
        return self.planned.rewrites_metadata

    def replaces(self, member: str) -> bool:
        return member == METADATA_FILE and self.planned.rewrites_metadata

    def added_bytes(self) -> int:
        return sum(entry.value.nbytes for entry in self.planned.entries if isinstance(entry.value, FreshTensor))

    def write(self, src: Path, dest: Path, *, meter: Meter) -> None:
        dest.mkdir(exist_ok=True)
        write_planned_dcp(src, self.planned, dest)
        if self.planned.rewrites_metadata:  # written in place of the original's, which the progress counts
            meter.writing((src / METADATA_FILE).stat().st_size)

    def verify(self, src: Path, dest: Path, meter: Meter) -> Verification:
        proven = verify_planned_dcp(src, dest, self.planned)
        meter.verifying(proven.bytes)
        return proven


def plan_file(path: Path, file: FileInventory, plan: RepairPlan, parsed: Parsed) -> PlannedFile:
    meta = parsed.dcp.get(file.file) or read_metadata(path, str(path))
    groups = {optimizer.address: [group.params for group in optimizer.groups] for optimizer in file.optimizers}
    source = display_path(str(path), METADATA_FILE)
    additions, changes, options = plan.for_file(file.file), plan.changes_for(file.file), plan.options_for(file.file)
    older = file.file in plan.older_forms
    return PlannedDcp(plan_dcp(meta, source, additions, changes, groups, options, older_form=older))
