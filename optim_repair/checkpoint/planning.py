"""The whole plan, finished before anything is written: each file's plan in its format, every refusal raised.

``fix`` finishes it before it creates the temporary copy; ``fix --dry-run`` and ``optim_repair.plan``
finish it too, so that they refuse exactly what ``fix`` would refuse, DCP's key plan included.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from optim_repair.checkpoint.discovery import Discovery
from optim_repair.checkpoint.reading import Parsed
from optim_repair.formats.dcp import METADATA_FILE, PlannedEntries, plan_dcp, read_metadata
from optim_repair.formats.dcp.metadata import display_path
from optim_repair.formats.torchfile import TorchFile, open_torch_file, plan_torch_file
from optim_repair.records.inventory import CheckpointInventory
from optim_repair.records.repair_plan import RepairPlan


@dataclass(frozen=True)
class FinishedPlan:
    """A repair plan every file accepted, with what each format's writer and verifier take from it."""

    plan: RepairPlan
    torch_files: Mapping[str, TorchFile] = field(default_factory=dict)
    """The torch files the plan edits, as reading parsed them, by path relative to the argument."""
    dcp: Mapping[str, PlannedEntries] = field(default_factory=dict)
    """Each DCP checkpoint's new entries and keys, by its directory relative to the argument."""


def finish_plan(
    found: Discovery, inventory: CheckpointInventory, plan: RepairPlan, parsed: Parsed | None = None
) -> FinishedPlan:
    """Plan every file of ``inventory`` in its format; raise ``RepairRefused`` (or ``InputError``) for the first
    thing a writer could not do. ``parsed`` holds what reading parsed; what it lacks is read again."""
    parsed = parsed or Parsed()
    torch_files: dict[str, TorchFile] = {}
    dcp: dict[str, PlannedEntries] = {}
    for file in inventory.files:
        rel = file.file
        path = found.target / rel if rel else found.target
        additions, changes = plan.for_file(rel), plan.changes_for(rel)
        if file.format == "dcp":
            source = display_path(str(path), METADATA_FILE)
            meta = parsed.dcp.get(rel) or read_metadata(path, str(path))
            groups = {optimizer.address: [group.params for group in optimizer.groups] for optimizer in file.optimizers}
            dcp[rel] = plan_dcp(meta, source, additions, changes, groups)
        elif additions or changes:
            source = rel or str(path)
            torch_file = parsed.torch_files.get(rel) or open_torch_file(path, source)
            plan_torch_file(torch_file, source, additions, changes)
            torch_files[rel] = torch_file
    return FinishedPlan(plan, torch_files, dcp)
