"""The atomic copy: a repaired, verified copy written beside the original, following the discovery list.

Everything is written into a temporary sibling of ``--out`` (``staging``), verified from disk, and
only then renamed into place. Any failure, an interrupt or a full disk included, removes the
temporary copy; the input is only ever opened for reading.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from pathlib import Path

from optim_repair.checkpoint.discovery import Discovery, Entry
from optim_repair.checkpoint.planning import FinishedPlan
from optim_repair.errors import InputError, OutputError, Remedy, VerificationError, os_error_reason, shown_name
from optim_repair.formats.copied import verify_copied_file, verify_copied_link
from optim_repair.formats.dcp import REPAIR_SHARD_PREFIX
from optim_repair.progress import QUIET, Meter, Notice, Reporter
from optim_repair.records.request import DEFAULT_COPY, CopyRequest
from optim_repair.records.verification import NOTHING, Verification
from optim_repair.storage.disk import kernel_copy, open_regular, size_of
from optim_repair.storage.disk_staging import move_into_place, refuse_to_replace, remove_stale, temporary_sibling


def check_output(source: Path, out: Path, *, force: bool) -> None:
    """Refuse an output path that would lose or overwrite anything it should not."""
    src, dst = source.resolve(), out.resolve()
    if dst == src or src in dst.parents:
        raise OutputError("{argument} must not be the input or inside it", path=out, argument="out")
    if dst in src.parents:
        raise OutputError("{argument} must not contain the input", path=out, argument="out")
    if out.exists() or out.is_symlink():
        if out.is_dir() and not source.is_dir():
            reason = f"is a directory; to write the copy into it, pass {{argument}} {shown_name(str(out))}/"
            raise OutputError(reason, path=str(out), argument="out")
        if not force:
            raise OutputError("already exists", path=str(out), remedy=Remedy("force", note=" to replace it"))
        refuse_to_replace(out)
        if out.is_dir() != source.is_dir():
            raise OutputError("is a file, and the copy of a directory is a directory", path=str(out))
        _refuse_other_than_a_copy(source, out)
    if not Path(os.path.abspath(out)).parent.is_dir():  # beside a link named out, wherever it points
        raise OutputError("no such directory for {argument}", path=out.parent, argument="out")


def _refuse_other_than_a_copy(source: Path, out: Path) -> None:
    """``--force`` replaces a directory only where it looks like an earlier copy of ``source``: every name at its
    top is one the checkpoint has, or the shard a repair of a DCP checkpoint adds. Else it says what it would
    delete (``--force --out ~`` deletes nothing)."""
    if out.is_symlink() or not out.is_dir():
        return
    try:
        theirs, ours = set(os.listdir(out)), set(os.listdir(source))
    except OSError as exc:
        raise OutputError(f"cannot be read ({os_error_reason(exc)})", path=str(out)) from exc
    foreign = sorted(name for name in theirs - ours if not name.startswith(REPAIR_SHARD_PREFIX))
    if foreign:
        shown = ", ".join(shown_name(name) for name in foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise OutputError(
            f"holds {len(foreign)} entries the checkpoint has none of ({shown}): it is no earlier copy, and "
            "--force replaces only one; remove it yourself, or choose another {argument}",
            path=str(out),
            argument="out",
        )


def _copy(source: Path, target: Path, rel: str, *, link: bool, meter: Meter, verify: bool = True) -> Verification:
    """Copy a file the repair does not change, the kernel moving the bytes (a reflink where the file system
    can), or hard-link it with ``link``; verify the copy unless its checkpoint's verification covers it."""
    if link:
        try:
            os.link(source, target, follow_symlinks=True)  # a followed link's file, not the link
        except OSError as exc:
            raise OutputError(
                f"cannot hard-link it into the copy ({os_error_reason(exc)}); "
                "write {argument} on the file system of the original, or copy instead of linking",
                path=source,
                argument="out",
            ) from exc
        return Verification(0, 0, linked=(rel,))
    with open_regular(source, rel or str(source)) as original:
        descriptor = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        try:
            size = size_of(original)
            kernel_copy(original.fileno(), descriptor, 0, size, 0, name=str(source))
        finally:
            os.close(descriptor)
    meter.writing(size)
    if not verify:
        return NOTHING
    verification = verify_copied_file(source, target, rel or str(source))
    meter.verifying(size)
    return verification


def _link_target(link: Path) -> str:
    """Where the link ``link``, which discovery found, points; refused when it is no longer a link."""
    try:
        return os.readlink(link)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            raise InputError(
                "changed while being copied: it was a symbolic link and is no longer one; run again once nothing "
                "writes to the checkpoint",
                path=link,
            ) from exc
        raise InputError(f"cannot read the link ({os_error_reason(exc)})", path=link) from exc


def _sync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _sync_copy(tmp: Path, meter: Meter) -> None:
    """fsync every file the copy wrote (not a hard link to the original's, not a link), then every directory,
    so that its entries survive a crash as its files do: one stage after writing, reported as ``sync``."""
    if not tmp.is_dir():
        _sync(tmp)
        meter.syncing(os.lstat(tmp).st_size)
        return
    directories = []
    for directory, _, names in os.walk(tmp):
        directories.append(directory)
        for name in names:
            path = os.path.join(directory, name)
            status = os.lstat(path)
            if stat.S_ISREG(status.st_mode) and status.st_nlink == 1:
                _sync(Path(path))
                meter.syncing(status.st_size)
    for directory in directories:
        _sync(Path(directory))


def _kept_link(entry: Entry, finished: FinishedPlan) -> bool:
    """Whether ``entry`` is copied as a link: every link discovery kept, but one to a file the repair rewrites
    (a torch file it changes, a DCP ``.metadata`` it extends), which the copy holds as a regular file."""
    if not entry.link:
        return False
    if entry.dcp is not None:
        return not finished.files[entry.dcp].replaces(entry.member_name())
    planned = finished.files.get(entry.rel) if entry.role == "torch" else None
    return planned is None or not planned.changes_anything


def _write_directory(
    found: Discovery, tmp: Path, finished: FinishedPlan, *, link: bool, sync: bool, meter: Meter, notice: Notice
) -> Verification:
    """Write every entry discovery listed into ``tmp``: the planned files by their adapters, the rest copied
    as they are (or hard-linked); then verify each planned file from disk."""
    total = NOTHING
    kept: list[str] = []
    for entry in found.entries:
        source, target = found.path(entry), tmp / entry.rel if entry.rel else tmp
        planned = finished.files.get(entry.rel) if entry.role in ("torch", "dcp") else None
        if _kept_link(entry, finished):
            os.symlink(_link_target(source), target)  # a link (even a dangling one) stays a link, as cp -R does
            kept.append(entry.rel)
        elif entry.role == "directory":
            target.mkdir()
        elif planned is not None:
            if planned.changes_anything:
                notice(f"writing {shown_name(entry.rel) if entry.rel else 'DCP checkpoint'}")
            planned.write(source, target, meter=meter)
        elif entry.dcp is not None and finished.files[entry.dcp].replaces(entry.member_name()):
            continue  # its adapter wrote it
        elif entry.dcp is not None:  # verified with its checkpoint, through the new metadata
            total += _copy(source, target, entry.rel, link=link, meter=meter, verify=False)
        else:
            total += _copy(source, target, entry.rel, link=link, meter=meter)
    if sync:
        _sync_copy(tmp, meter)
    for rel in kept:
        verify_copied_link(found.target / rel, tmp / rel, rel)
    for rel, planned in finished.files.items():
        if rel not in kept:
            total += planned.verify(found.target / rel if rel else found.target, tmp / rel if rel else tmp, meter)
    return total


def _written_bytes(found: Discovery, finished: FinishedPlan, *, link: bool) -> int:
    """The bytes of the checkpoint's files the copy writes: every file but those hard-linked (``link``) and
    links. A file an adapter writes anew (a torch file, a DCP ``.metadata``) is never hard-linked. The one
    count both the space check and the progress use."""
    if not found.is_directory:
        return os.stat(found.target).st_size

    def rewritten(entry: Entry) -> bool:
        if entry.dcp is not None:
            return finished.files[entry.dcp].replaces(entry.member_name())
        return entry.rel in finished.files

    return sum(
        os.stat(found.path(entry)).st_size
        for entry in found.entries
        if entry.role not in ("directory", "special", "dcp")
        and not _kept_link(entry, finished)
        and (not link or rewritten(entry))
    )


def space_needed(found: Discovery, finished: FinishedPlan, *, link: bool) -> int:
    """About how many bytes the copy takes on the disk: every file not hard-linked, and the added entries."""
    return _written_bytes(found, finished, link=link) + finished.added_bytes()


def free_space(out: Path) -> int:
    """The bytes free to an unprivileged writer on the file system that will hold ``out``."""
    parent = Path(os.path.abspath(out)).parent
    try:
        return shutil.disk_usage(parent).free
    except OSError as exc:
        raise OutputError(f"cannot write ({os_error_reason(exc)})", path=parent) from exc


def preflight(found: Discovery, finished: FinishedPlan, out: Path, *, force: bool, link: bool) -> None:
    """What ``write_copy`` refuses before it writes a byte: an ``out`` it may not replace or write beside the
    input, a file it cannot copy, too little room. ``fix --dry-run`` refuses the same (and ``probe``s ``out``)."""
    check_output(found.root, out, force=force)
    special = [entry for entry in found.entries if entry.role == "special"]
    if special:
        raise InputError(
            f"is {special[0].kind}; optim-repair copies only regular files, directories and links",
            path=found.root / special[0].rel,
        )
    check_room(space_needed(found, finished, link=link), out)


def check_room(needed: int, out: Path) -> None:
    """Refuse a copy of about ``needed`` bytes where the file system that would hold ``out`` has less free."""
    free = free_space(out)
    if needed > free:
        raise OutputError(
            f"the copy needs about {needed:,} bytes and only {free:,} are free there; nothing was written",
            path=Path(os.path.abspath(out)).parent,
        )


def probe(out: Path, *, directory: bool) -> None:
    """Create and remove the temporary sibling ``write_copy`` would write into: what a dry run asks of ``out``'s
    directory (that it exists and can be written), refused as the run would refuse it."""
    with temporary_sibling(out, directory=directory):
        pass


def write_copy(
    found: Discovery,
    finished: FinishedPlan,
    out: Path,
    copy: CopyRequest = DEFAULT_COPY,
    reporter: Reporter = QUIET,
) -> Verification:
    """Write the repaired copy of what ``found`` lists, as ``finished`` plans it, to ``out`` and verify it;
    return what was proven.

    With ``copy.sync`` (the default) every file and directory written is synced to the disk before it is
    verified and renamed into place, and the directory holding ``out`` after. ``reporter`` hears of the
    bytes written and verified, and gets lines of text for the user.
    """
    force, link, sync, notice = copy.force, copy.link, copy.sync, reporter.notice
    source = found.target
    preflight(found, finished, out, force=force, link=link)
    remove_stale(out, notice)
    meter = Meter(reporter.progress, _written_bytes(found, finished, link=link))
    with temporary_sibling(out, directory=found.is_directory) as tmp:
        try:
            if found.is_directory:
                verification = _write_directory(found, tmp, finished, link=link, sync=sync, meter=meter, notice=notice)
            else:
                notice(f"writing {shown_name(str(out))}")
                planned = finished.files[""]
                planned.write(source, tmp, meter=meter)
                if sync:
                    _sync_copy(tmp, meter)
                verification = planned.verify(source, tmp, meter)
            found.check_unchanged()  # what was copied and proven is what was read
            move_into_place(tmp, out, force=force, sync=sync)
        except OSError as exc:
            reason = f"cannot write ({os_error_reason(exc)}); nothing was left behind"
            raise OutputError(reason, path=out) from exc
        except InputError as exc:
            raise InputError(f"{exc.reason}; nothing was written", path=exc.path) from exc
        except VerificationError as exc:
            try:
                found.check_unchanged()  # a difference from an original that changed meanwhile is the input's
            except InputError as changed:
                raise InputError(f"{changed.reason}; nothing was written", path=changed.path) from exc
            raise VerificationError(f"{exc.reason}; the copy was removed", path=exc.path) from exc
    return verification
