"""What a format's adapter gives the pipeline: what reading parsed, and each file's plan finished in its format.

An adapter plans one file of the inventory in its format (every refusal raised before anything is written)
and returns a ``PlannedFile``. The planned file writes itself into the copy, says which of the checkpoint's
files it writes in place of a copy (``replaces``) and how many bytes it adds, and proves itself from disk.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from optim_repair.formats.dcp import DcpMetadata
from optim_repair.formats.torchfile import TorchFile
from optim_repair.progress import Meter
from optim_repair.records.repair_plan import Addition, FreshTensor
from optim_repair.records.verification import Verification


@dataclass(frozen=True)
class Parsed:
    """What reading parsed, returned with the inventory so that planning and writing need not parse it again.
    Nothing changes it: the writers build what they write anew."""

    torch_files: Mapping[str, TorchFile] = field(default_factory=dict)
    """The torch files that hold optimizers, by path relative to the argument."""
    dcp: Mapping[str, DcpMetadata] = field(default_factory=dict)
    """The metadata of each DCP checkpoint, by its directory relative to the argument."""


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


def added_bytes(additions: tuple[Addition, ...]) -> int:
    return sum(value.nbytes for addition in additions for _, value in addition.state if isinstance(value, FreshTensor))


class Tally:
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
