"""The DeepSpeed universal checkpoint's adapter: copied as it is; writing DeepSpeed's per-parameter files is refused."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from optim_repair.errors import RepairRefused
from optim_repair.formats.planned import Parsed
from optim_repair.progress import Meter
from optim_repair.records.inventory import FileInventory
from optim_repair.records.repair_plan import RepairPlan
from optim_repair.records.verification import NOTHING, Verification


@dataclass(frozen=True)
class PlannedUniversal:
    """A universal checkpoint in the copy: every file of it copied as it is, each proven as copied."""

    @property
    def changes_anything(self) -> bool:
        return False

    def replaces(self, member: str) -> bool:
        return False

    def added_bytes(self) -> int:
        return 0

    def write(self, src: Path, dest: Path, *, meter: Meter) -> None:
        """Nothing: its files are copied as the directory's others are."""

    def verify(self, src: Path, dest: Path, meter: Meter) -> Verification:
        return NOTHING  # each of its files is proven as it is copied


def plan_file(path: Path, file: FileInventory, plan: RepairPlan, parsed: Parsed) -> PlannedUniversal:
    """A universal checkpoint is copied as it is: writing DeepSpeed's per-parameter state is refused."""
    if plan.for_file(file.file) or plan.changes_for(file.file) or plan.options_for(file.file):
        raise RepairRefused(
            "a DeepSpeed universal checkpoint: writing its per-parameter state files is not supported; DeepSpeed "
            "writes a state file for every parameter it steps, so one missing is a damaged conversion: convert the "
            "ZeRO checkpoint again with ds_to_universal",
            path=str(path),
        )
    return PlannedUniversal()
