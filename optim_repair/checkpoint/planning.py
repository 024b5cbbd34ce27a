"""The whole plan, finished before anything is written: each file's plan in its format, every refusal raised.

``fix`` finishes it before it creates the temporary copy; ``fix --dry-run`` and ``optim_repair.plan``
finish it too, so that they refuse exactly what ``fix`` would refuse, DCP's key plan included. Each file
is planned by the adapter of its format (``formats.registry.ADAPTERS``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from optim_repair.formats.planned import Parsed, PlannedFile
from optim_repair.formats.registry import ADAPTERS
from optim_repair.records.inventory import CheckpointInventory
from optim_repair.records.repair_plan import RepairPlan


@dataclass(frozen=True)
class FinishedPlan:
    """A repair plan every file accepted, with each file's plan in its format."""

    plan: RepairPlan
    files: Mapping[str, PlannedFile]
    """Each file (or DCP checkpoint) that holds optimizers, by path relative to the argument."""

    def added_bytes(self) -> int:
        return sum(planned.added_bytes() for planned in self.files.values())


def finish_plan(
    target: Path, inventory: CheckpointInventory, plan: RepairPlan, parsed: Parsed | None = None
) -> FinishedPlan:
    """Plan every file of ``inventory`` (read under ``target``) in its format; raise ``RepairRefused`` (or
    ``InputError``) for the first thing a writer could not do. ``parsed`` holds what reading parsed; what it
    lacks is read again."""
    parsed = parsed or Parsed()
    files = {}
    for file in inventory.files:
        path = target / file.file if file.file else target
        files[file.file] = ADAPTERS[file.format](path, file, plan, parsed)
    return FinishedPlan(plan, files)
