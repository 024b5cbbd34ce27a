"""The torch file's adapter: a file's plan finished in the zip or legacy format, written anew, proven from disk.

The pipeline plans a torch file here (``plan_file``: every refusal raised before anything is written) and gets
a ``PlannedTorchFile``, which writes itself into a copy and proves itself against the original. For a file in a
store it can also splice itself (``PlannedTorchFile.splice``), its capability of being repaired where it lies:
a new pickle record, the original's bytes from its second record to its central directory, the new storages and
a new central directory (``splice``). The splice is proven before a byte is written, as a local copy is, by
reading it back through a file joined from the new head and tail and the original's kept range (read as the
proof needs it): its graph, framing and new storages, every original storage found where it was kept.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import BinaryIO

from optim_repair.errors import UsageError
from optim_repair.formats.planned import Parsed, PlannedFile, Tally, added_bytes
from optim_repair.formats.torchfile import TorchFile, open_torch_file, plan_torch_file, write_torch_file
from optim_repair.formats.torchfile.splice import Splice, append, splice
from optim_repair.formats.torchfile.verifier import verify_torch_file
from optim_repair.formats.torchfile.writer import new_pickle
from optim_repair.formats.torchfile.zipformat import ZipTorchFile
from optim_repair.progress import Meter
from optim_repair.records.inventory import FileInventory
from optim_repair.records.repair_plan import Addition, ParamChange, RepairPlan
from optim_repair.records.verification import HolderProof, Verification
from optim_repair.storage.ranged import Joined


@dataclass(frozen=True)
class Spliced:
    """A torch file's repaired copy, spliced and proven, not yet written: its new head and tail (in a local scratch
    file) around the original's kept range."""

    made: Splice
    scratch: Path
    original: Callable[[], BinaryIO]
    proven: Verification

    def joined(self) -> BinaryIO:
        """The spliced file: the new head, the original's kept range, the new tail."""
        made = self.made
        parts = [(self.scratch.open("rb"), 0, made.head), (self.original(), made.start, made.end - made.start)]
        return io.BufferedReader(Joined([*parts, (self.scratch.open("rb"), made.tail_at, made.tail)]))

    def head_and_tail(self) -> tuple[bytes, bytes]:
        """The bytes before and after the original's kept range."""
        with self.scratch.open("rb") as stream:
            head = stream.read(self.made.head)
            stream.seek(self.made.tail_at)
            return head, stream.read(self.made.tail)


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
        return added_bytes(self.additions)

    def write(self, src: Path, dest: Path, *, meter: Meter) -> None:
        # The writer and the verifier report the storages they move and compare; the rest of the file
        # (its pickle, headers and framing) is reported when each is done, so that stages end at the total.
        tally = Tally(meter.writing)
        write_torch_file(
            src, self.source, self.additions, dest, changes=self.changes, parsed=self.original, on_bytes=tally,
        )  # fmt: skip
        tally.top_up(src.stat().st_size)

    def splice(self, original: Callable[[], BinaryIO], scratch: Path, *, appended: bool = False) -> Spliced:
        """The repaired copy spliced around the original (opened by ``original``) and proven, its new head and tail
        written to the new local file ``scratch``; with ``appended``, the whole original followed by a tail
        (``splice.append``). A repair that drops state is refused (its records would be orphaned)."""
        torch_file, source = self.original, self.source
        assert isinstance(torch_file, ZipTorchFile)  # a store's legacy-format files are not read
        data, created, dropped = new_pickle(torch_file, source, self.additions, self.changes)
        if dropped:
            raise UsageError(f"{source}: dropping state from a torch file in a store is done into a local copy")
        with scratch.open("w+b") as written:
            if appended:
                with original() as stream:
                    size = stream.seek(0, io.SEEK_END)
                made = append(torch_file, size, data, created, written.fileno(), source)
            else:
                made = splice(torch_file, data, created, written.fileno(), source)
        spliced = Spliced(made, scratch, original, Verification(0, 0))
        proven = verify_torch_file(
            Path(source), Path(source), source, self.additions, changes=self.changes, parsed=torch_file,
            openers=(original, spliced.joined), holder=HolderProof(kept=(made.start, made.end, made.moved)),
        )  # fmt: skip
        return replace(spliced, proven=proven)

    def verify(self, src: Path, dest: Path, meter: Meter) -> Verification:
        tally = Tally(meter.verifying)
        verification = verify_torch_file(
            src, dest, self.source, self.additions, changes=self.changes, parsed=self.original, on_bytes=tally
        )
        tally.top_up(src.stat().st_size)
        return verification


def plan_file(path: Path, file: FileInventory, plan: RepairPlan, parsed: Parsed) -> PlannedFile:
    source = file.file or str(path)
    original = parsed.torch_files.get(file.file) or open_torch_file(path, source)
    additions, changes = plan.for_file(file.file), plan.changes_for(file.file)
    plan_torch_file(original, source, additions, changes)
    return PlannedTorchFile(source, original, additions, changes)
