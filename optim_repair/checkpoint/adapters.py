"""One adapter per format that holds optimizers, chosen from a table by the role discovery gave the file.

An adapter plans one file of the inventory in its format (``plan``: every refusal raised before anything
is written) and returns a ``PlannedFile``. The planned file writes itself into the copy, says which of
the checkpoint's files it writes in place of a copy (``replaces``) and how many bytes it adds, and proves
itself from disk. ``writing`` copies everything else as it is. A new format is one adapter and one row of
``ADAPTERS``; a new kind of plan record is handled once in each adapter's format.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from optim_repair.checkpoint.discovery import Role
from optim_repair.checkpoint.reading import Parsed
from optim_repair.formats.dcp import METADATA_FILE, PlannedEntries, plan_dcp, read_metadata
from optim_repair.formats.dcp.metadata import display_path
from optim_repair.formats.dcp.verifier import verify_planned_dcp
from optim_repair.formats.dcp.writer import write_planned_dcp
from optim_repair.formats.torchfile import TorchFile, open_torch_file, plan_torch_file, write_torch_file
from optim_repair.formats.torchfile.verifier import verify_torch_file
from optim_repair.progress import Meter
from optim_repair.records.inventory import FileInventory
from optim_repair.records.repair_plan import Addition, FreshTensor, ParamChange, RepairPlan
from optim_repair.records.verification import Verification


class PlannedFile(Protocol):
    """One file (or DCP checkpoint) of the copy with its plan finished in its format."""

    @property
    def changes_anything(self) -> bool:
        """Whether the plan adds, renames or drops anything here."""

    def replaces(self, member: str) -> bool:
        """Whether it writes ``member`` (a path inside a DCP checkpoint) itself, instead of a copy of it."""

    def added_bytes(self) -> int:
        """About how many bytes the planned additions add to the copy."""

    def write(self, src: Path, dest: Path, *, meter: Meter) -> None:
        """Write it into ``dest`` (a new file, or the DCP checkpoint's directory); ``writing`` syncs it."""

    def verify(self, src: Path, dest: Path, meter: Meter) -> Verification:
        """Prove the copy at ``dest`` from disk against the original at ``src`` and the plan alone."""


def _added_bytes(additions: tuple[Addition, ...]) -> int:
    return sum(value.nbytes for addition in additions for _, value in addition.state if isinstance(value, FreshTensor))


@dataclass(frozen=True)
class PlannedTorchFile:
    """A torch file: its graph pickled anew with the plan applied, every storage it still names copied."""

    source: str
    original: TorchFile
    """The file as reading parsed it: the writer builds a new graph, the verifier compares with this one."""
    additions: tuple[Addition, ...]
    changes: tuple[ParamChange, ...]

    @property
    def changes_anything(self) -> bool:
        return bool(self.additions or self.changes)

    def replaces(self, member: str) -> bool:
        return False

    def added_bytes(self) -> int:
        return _added_bytes(self.additions)

    def write(self, src: Path, dest: Path, *, meter: Meter) -> None:
        # The writer and the verifier report the storages they move and compare; the rest of the file
        # (its pickle, headers and framing) is reported when each is done, so that stages end at the total.
        tally = _Tally(meter.writing)
        write_torch_file(
            src, self.source, self.additions, dest, changes=self.changes, parsed=self.original, on_bytes=tally,
        )  # fmt: skip
        tally.top_up(src.stat().st_size)

    def verify(self, src: Path, dest: Path, meter: Meter) -> Verification:
        tally = _Tally(meter.verifying)
        verification = verify_torch_file(
            src, dest, self.source, self.additions, changes=self.changes, parsed=self.original, on_bytes=tally
        )
        tally.top_up(src.stat().st_size)
        return verification


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


class _Tally:
    """Passes byte counts on, remembering their sum, and can bring the sum up to a file's size."""

    def __init__(self, report: Callable[[int], None]) -> None:
        self._report = report
        self._sum = 0

    def __call__(self, nbytes: int) -> None:
        self._sum += nbytes
        self._report(nbytes)

    def top_up(self, size: int) -> None:
        if size > self._sum:
            self(size - self._sum)


def _plan_torch_file(path: Path, file: FileInventory, plan: RepairPlan, parsed: Parsed) -> PlannedFile:
    source = file.file or str(path)
    original = parsed.torch_files.get(file.file) or open_torch_file(path, source)
    additions, changes = plan.for_file(file.file), plan.changes_for(file.file)
    plan_torch_file(original, source, additions, changes)
    return PlannedTorchFile(source, original, additions, changes)


def _plan_dcp(path: Path, file: FileInventory, plan: RepairPlan, parsed: Parsed) -> PlannedFile:
    meta = parsed.dcp.get(file.file) or read_metadata(path, str(path))
    groups = {optimizer.address: [group.params for group in optimizer.groups] for optimizer in file.optimizers}
    source = display_path(str(path), METADATA_FILE)
    return PlannedDcp(plan_dcp(meta, source, plan.for_file(file.file), plan.changes_for(file.file), groups))


Adapter = Callable[[Path, FileInventory, RepairPlan, Parsed], PlannedFile]
"""Plans one file of the inventory (at its path) in its format; raises what its writer would refuse."""

ADAPTERS: Mapping[Role, Adapter] = {"torch": _plan_torch_file, "dcp": _plan_dcp}
"""The adapter of each role that holds optimizers."""
