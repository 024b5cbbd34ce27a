"""The atomic copy: a repaired, verified copy written beside the original, following the discovery list.

Everything is written into a temporary sibling of ``--out`` (``staging``), verified from disk, and
only then renamed into place. Any failure, an interrupt or a full disk included, removes the
temporary copy; the input is only ever opened for reading.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from optim_repair.checkpoint.discovery import Discovery
from optim_repair.checkpoint.planning import FinishedPlan, finish_plan
from optim_repair.checkpoint.reading import Parsed
from optim_repair.checkpoint.staging import move_into_place, remove_stale, temporary_sibling
from optim_repair.errors import InputError, OutputError, Remedy, VerificationError, os_error_reason
from optim_repair.formats.copied import verify_copied_file
from optim_repair.formats.dcp import METADATA_FILE
from optim_repair.formats.dcp.verifier import verify_planned_dcp
from optim_repair.formats.dcp.writer import write_planned_dcp
from optim_repair.formats.inputs import open_regular, size_of
from optim_repair.formats.ranges import kernel_copy
from optim_repair.formats.torchfile import write_torch_file
from optim_repair.formats.torchfile.verifier import verify_torch_file
from optim_repair.progress import Meter, Notice, Progress, ignore
from optim_repair.records.inventory import CheckpointInventory
from optim_repair.records.repair_plan import FreshTensor, RepairPlan
from optim_repair.records.verification import NOTHING, Verification


def check_output(source: Path, out: Path, *, force: bool) -> None:
    """Refuse an output path that would lose or overwrite anything it should not."""
    src, dst = source.resolve(), out.resolve()
    if dst == src or src in dst.parents:
        raise OutputError("{argument} must not be the input or inside it", path=out, argument="out")
    if dst in src.parents:
        raise OutputError("{argument} must not contain the input", path=out, argument="out")
    if out.exists() or out.is_symlink():
        if not force:
            raise OutputError("already exists", path=str(out), remedy=Remedy("force", note=" to replace it"))
        if out.is_dir() != source.is_dir():
            raise OutputError(f"exists and is not a {'directory' if source.is_dir() else 'file'}", path=str(out))
    if not Path(os.path.abspath(out)).parent.is_dir():  # beside a link named out, wherever it points
        raise OutputError("no such directory for {argument}", path=out.parent, argument="out")


def _write_file(src: Path, dest: Path, rel: str, finished: FinishedPlan, *, sync: bool, meter: Meter) -> Verification:
    """Write a torch file with its planned changes into the empty file ``dest``, and verify it against the
    original as reading parsed it and the plan: nothing the writer made reaches the verifier."""
    source = rel or str(src)
    additions, changes = finished.plan.for_file(rel), finished.plan.changes_for(rel)
    parsed = finished.torch_files.get(rel)
    size = os.stat(src).st_size
    # The writer and the verifier report the storages they move and compare; the rest of the file
    # (its pickle, headers and framing) is reported when each is done, so that stages end at the total.
    written = _Tally(meter.writing)
    write_torch_file(src, source, additions, dest, changes=changes, sync=sync, parsed=parsed, on_bytes=written)
    written.top_up(size)
    verified = _Tally(meter.verifying)
    verification = verify_torch_file(src, dest, source, additions, changes=changes, parsed=parsed, on_bytes=verified)
    verified.top_up(size)
    return verification


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


def _copy(
    source: Path, target: Path, rel: str, *, link: bool, sync: bool, meter: Meter, verify: bool = True
) -> Verification:
    """Copy a file the repair does not change, the kernel moving the bytes (a reflink where the file system
    can), or hard-link it with ``link``; verify the copy unless its checkpoint's verification covers it."""
    if link:
        try:
            os.link(source, target)
        except OSError as exc:
            raise OutputError(
                f"cannot hard-link {source} ({os_error_reason(exc)}); "
                "write the copy on the same file system, or copy instead of linking",
                path=target,
            ) from exc
        return Verification(0, 0, linked=(rel,))
    with open_regular(source, rel or str(source)) as original:
        descriptor = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        try:
            size = size_of(original)
            kernel_copy(original.fileno(), descriptor, 0, size, 0)
            if sync:
                os.fsync(descriptor)
        finally:
            os.close(descriptor)
    meter.writing(size)
    if not verify:
        return NOTHING
    verification = verify_copied_file(source, target, rel or str(source))
    meter.verifying(size)
    return verification


def _sync_directories(root: Path) -> None:
    """fsync every directory of a written tree, so that its entries survive a crash as its files do."""
    for directory, _, _ in os.walk(root):
        descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def _rewritten(finished: FinishedPlan, dcp: str) -> bool:
    """Whether the plan gives the DCP checkpoint ``dcp`` a new ``.metadata`` (else its own is copied)."""
    return finished.dcp[dcp].rewrites_metadata


def _write_directory(
    found: Discovery,
    tmp: Path,
    finished: FinishedPlan,
    inventory: CheckpointInventory,
    *,
    link: bool,
    sync: bool,
    meter: Meter,
    notice: Notice,
) -> Verification:
    total = NOTHING
    plan = finished.plan
    optimizer_files = {file.file for file in inventory.files}
    for entry in found.entries:
        source, target = found.path(entry), tmp / entry.rel if entry.rel else tmp
        if entry.link:
            os.symlink(os.readlink(source), target)  # a link (even a dangling one) stays a link, as cp -R does
        elif entry.role == "directory":
            target.mkdir()
        elif entry.role == "dcp":
            target.mkdir(exist_ok=True)
            notice(f"writing {entry.rel or 'DCP checkpoint'}")
            write_planned_dcp(source, finished.dcp[entry.rel], target, sync=sync)
        elif (
            entry.dcp is not None and entry.member_name() == METADATA_FILE and finished.dcp[entry.dcp].rewrites_metadata
        ):
            continue  # replaced by the metadata write_planned_dcp wrote
        elif entry.rel in optimizer_files:
            if plan.for_file(entry.rel) or plan.changes_for(entry.rel):
                notice(f"writing {entry.rel}")
            total += _write_file(source, target, entry.rel, finished, sync=sync, meter=meter)
        elif entry.dcp is not None:  # verified with its checkpoint, through the new metadata
            total += _copy(source, target, entry.rel, link=link, sync=sync, meter=meter, verify=False)
        else:
            total += _copy(source, target, entry.rel, link=link, sync=sync, meter=meter)
    if sync:
        _sync_directories(tmp)
    for rel, planned in finished.dcp.items():
        directory = found.target / rel if rel else found.target
        proven = verify_planned_dcp(directory, tmp / rel if rel else tmp, planned)
        meter.verifying(proven.bytes)
        total += proven
    return total


def _bytes_to_copy(found: Discovery, inventory: CheckpointInventory, *, link: bool) -> int:
    """What a copy will write and verify, in bytes, for the progress it reports."""
    if not found.is_directory:
        return os.stat(found.target).st_size
    rewritten = {file.file for file in inventory.files}
    return sum(
        os.lstat(found.path(entry)).st_size
        for entry in found.entries
        if entry.role in ("torch", "safetensors", "file") and not entry.link and (not link or entry.rel in rewritten)
    )


def space_needed(found: Discovery, inventory: CheckpointInventory, plan: RepairPlan, *, link: bool) -> int:
    """About how many bytes the copy takes on the disk: every file not hard-linked, and the added entries."""
    rewritten = {file.file for file in inventory.files}
    added = sum(value.nbytes for a in plan.additions for _, value in a.state if isinstance(value, FreshTensor))
    if not found.is_directory:
        return os.stat(found.target).st_size + added
    copied = sum(
        os.lstat(found.path(entry)).st_size
        for entry in found.entries
        if entry.role not in ("directory", "special")
        and not entry.link
        and not (link and entry.rel not in rewritten and not (entry.dcp and entry.member_name() == METADATA_FILE))
    )
    return copied + added


def free_space(out: Path) -> int:
    """The bytes free to an unprivileged writer on the file system that will hold ``out``."""
    parent = Path(os.path.abspath(out)).parent
    try:
        return shutil.disk_usage(parent).free
    except OSError as exc:
        raise OutputError(f"cannot write ({os_error_reason(exc)})", path=parent) from exc


def write_copy(
    found: Discovery,
    inventory: CheckpointInventory,
    plan: RepairPlan,
    out: Path,
    *,
    force: bool = False,
    link: bool = False,
    sync: bool = True,
    parsed: Parsed | None = None,
    progress: Progress = ignore,
    notice: Notice = lambda message: None,
) -> Verification:
    """Write the repaired copy of what ``found`` lists to ``out`` and verify it; return what was proven.

    With ``sync`` (the default) every file and directory written is synced to the disk before it is
    verified and renamed into place, and the directory holding ``out`` after. ``parsed`` holds what
    reading parsed, so that it is not parsed again. ``progress`` hears of the bytes written and verified;
    ``notice`` gets lines of text for the user.
    """
    source = found.target
    check_output(found.root, out, force=force)
    special = [entry for entry in found.entries if entry.role == "special"]
    if special:
        raise InputError(
            f"is {special[0].kind}; optim-repair copies only regular files, directories and links",
            path=found.root / special[0].rel,
        )
    finished = finish_plan(found, inventory, plan, parsed)  # what cannot be done is refused first
    needed, free = space_needed(found, inventory, plan, link=link), free_space(out)
    if needed > free:
        raise OutputError(
            f"the copy needs about {needed:,} bytes and only {free:,} are free there; nothing was written",
            path=Path(os.path.abspath(out)).parent,
        )
    remove_stale(out, notice)
    meter = Meter(progress, _bytes_to_copy(found, inventory, link=link))
    with temporary_sibling(out, directory=found.is_directory) as tmp:
        try:
            if found.is_directory:
                verification = _write_directory(
                    found, tmp, finished, inventory, link=link, sync=sync, meter=meter, notice=notice
                )
            else:
                notice(f"writing {out}")
                verification = _write_file(source, tmp, "", finished, sync=sync, meter=meter)
            move_into_place(tmp, out, force=force, sync=sync)
        except OSError as exc:
            reason = f"cannot write ({os_error_reason(exc)}); nothing was left behind"
            raise OutputError(reason, path=out) from exc
        except VerificationError as exc:
            raise VerificationError(f"{exc.reason}; the copy was removed", path=exc.path) from exc
    return verification
