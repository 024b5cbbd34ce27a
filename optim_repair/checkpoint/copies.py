"""The repaired copy written where ``out`` is: one call, the writer chosen by where the checkpoint and the copy are.

A disk to a disk: ``writing.write_copy`` (a temporary sibling, renamed into place once proven). A store to the same
store: ``store_writing.write_in_store`` (server-side copies, the changed files staged and proven locally, committed
under a claim). A disk to a store: the copy written and proven in a private temporary directory, then uploaded
under a claim. A store to a disk: the checkpoint was read with its objects fetched beside ``out``
(``mirror_beside``): they are downloaded there, and the copy is written from them as from any local checkpoint,
every unchanged file hard-linked. Each is planned once, from the one reading of the checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from optim_repair.checkpoint import store_writing
from optim_repair.checkpoint.discovery import Discovery, discover
from optim_repair.checkpoint.planning import FinishedPlan
from optim_repair.checkpoint.reading import DiskListing, Listing
from optim_repair.checkpoint.stored import StoredCheckpoint, local_name
from optim_repair.checkpoint.writing import check_room, free_space, preflight, probe, space_needed, write_copy
from optim_repair.errors import OutputError, Remedy, counted
from optim_repair.formats.registry import role_of
from optim_repair.progress import Meter, Reporter
from optim_repair.records.request import CopyRequest
from optim_repair.records.traffic import Traffic
from optim_repair.records.verification import UPLOADED, Verification
from optim_repair.storage.disk_staging import recorded_placements, remove_stale, temporary_sibling
from optim_repair.storage.schemes import StoreOptions, is_remote, parse_url

Written = tuple[Path | str, Verification, Traffic | None]
"""Where the copy is (a path, or a URL in a store), what was proven, and what the store's requests moved."""


def _into(out: str, name: str, one_file: bool) -> str:
    """Where a copy goes: ``out``, or for one file and an ``out`` ending in a slash (a directory, or a prefix in a
    store), the file's name inside it, as ``cp`` does."""
    return f"{out}{name}" if one_file and out.endswith(("/", os.sep)) else out


def output_path(checkpoint: Path, out: str | Path) -> Path:
    """Where ``fix`` writes a local checkpoint on a disk."""
    return Path(_into(os.fspath(out), checkpoint.name, not checkpoint.is_dir()))


def upload_key(found: Discovery, out: str) -> str:
    """Where a local checkpoint goes in a store."""
    return _into(out, found.root.name, not found.is_directory)


def local_target(checkpoint: str, out: str | Path) -> Path:
    """Where a copy of the checkpoint ``checkpoint`` in a store goes on a disk (a torch or safetensors key is one
    file)."""
    url = parse_url(checkpoint)
    return Path(_into(os.fspath(out), local_name(url), role_of(url.key) in ("torch", "safetensors")))


@contextlib.contextmanager
def mirror_beside(checkpoint: str, out: str | Path, *, force: bool, reporter: Reporter) -> Iterator[Path]:
    """For a copy of the checkpoint ``checkpoint`` in a store to the local ``out``: a temporary directory beside
    where the copy goes, to fetch its objects into (on the copy's file system, so that the copy hard-links them),
    locked while the run lives and removed after it (or by the next run, after a kill). Refused before a request
    is sent when the copy's place is taken (without ``force``)."""
    target = local_target(checkpoint, out)
    if (target.exists() or target.is_symlink()) and not force:
        raise OutputError("already exists", path=str(target), remedy=Remedy("force", note=" to replace it"))
    remove_stale(target, reporter.notice)
    with temporary_sibling(target, directory=True) as mirror:
        yield mirror


def write(
    listing: Listing, finished: FinishedPlan, out: str | Path, copy: CopyRequest, options: StoreOptions,
    reporter: Reporter,
) -> Written:  # fmt: skip
    """Write the repaired copy of what ``listing`` found, as ``finished`` plans it, to ``out``, and prove it."""
    if isinstance(listing, StoredCheckpoint):
        if is_remote(out):
            verification, traffic = store_writing.write_in_store(
                listing, finished, os.fspath(out), force=copy.force, read_back=copy.read_back, reporter=reporter
            )
            return os.fspath(out), verification, traffic
        return _downloaded(listing, finished, out, copy, reporter)
    assert isinstance(listing, DiskListing)  # the two listings there are
    if is_remote(out):
        return _uploaded(listing.found, finished, os.fspath(out), copy, options, reporter)
    target = output_path(listing.found.root, out)
    return target, write_copy(listing.found, finished, target, copy, reporter), None


def _downloaded(
    listing: StoredCheckpoint, finished: FinishedPlan, out: str | Path, copy: CopyRequest, reporter: Reporter
) -> Written:
    """The copy of a checkpoint in a store, read with its objects fetched beside ``out`` (``mirror_beside``):
    the rest downloaded there, each checked against the store's CRC32, and the copy written from them with every
    unchanged file hard-linked. Refused before a byte moves when the copy's file system lacks room."""
    target, total = local_target(str(listing.url), out), listing.size()
    if Path(os.path.abspath(target)).parent.is_dir() and total > free_space(target):
        reason = f"has {free_space(target):,} bytes free, too few to download {total:,}"
        raise OutputError(reason, path=str(target.parent))
    reporter.notice(f"downloading {counted(len(listing.listing), 'object')} ({total:,} bytes) beside {target}")
    listing.download(Meter(reporter.progress, total).writing)
    verification = write_copy(discover(listing.local), finished, target, replace(copy, link=True), reporter)
    return target, verification, listing.traffic()


def _uploaded(
    found: Discovery, finished: FinishedPlan, out: str, copy: CopyRequest, options: StoreOptions, reporter: Reporter
) -> Written:
    """The copy of a local checkpoint in a store: written into a temporary directory under ``TMPDIR`` (unchanged
    files hard-linked where it shares the checkpoint's file system, not synced; locked while the run lives, and
    removed by the next run after a kill), proven there, then uploaded (``store_writing.upload_copy``). The
    checkpoint's own directory is never written to."""
    key = upload_key(found, out)
    private = Path(tempfile.gettempdir()) / "optim-repair-upload"  # the stand-in its temporaries are named for
    remove_stale(private, reporter.notice)  # what a killed upload left
    with temporary_sibling(private, directory=True) as tmp:
        staged = tmp / found.root.name
        link = os.stat(tmp).st_dev == os.stat(found.target).st_dev
        with recorded_placements():  # the staged copy is this run's own, never a copy the user was given
            verification = write_copy(found, finished, staged, CopyRequest(link=link, sync=False), reporter)
        traffic, checked_by = store_writing.upload_copy(
            staged, key, force=copy.force, options=options, reporter=reporter
        )
    return key, replace(verification, proof=f"{UPLOADED}{checked_by}"), traffic


def estimate(
    listing: Listing, finished: FinishedPlan, out: str | Path, *, link: bool, force: bool, options: StoreOptions
) -> tuple[Path | str, int, int | None]:
    """Where ``write`` would put the copy, about how many bytes it would write (hard-linked files excluded), and
    the bytes free where it would go (None in a store, which sets no such bound). The copy is refused as
    ``write`` would refuse it before writing: on this machine, what is at ``out`` and the room there
    (``writing.preflight``; its directory ``probe``d); in a store, where it would go and what is there."""
    if isinstance(listing, StoredCheckpoint):
        needed = listing.size() + finished.added_bytes()
        if is_remote(out):
            store_writing.refused_in_store(listing, os.fspath(out), force=force)
            return os.fspath(out), needed, None
        target = local_target(str(listing.url), out)
        if (target.exists() or target.is_symlink()) and not force:
            raise OutputError("already exists", path=str(target), remedy=Remedy("force", note=" to replace it"))
        check_room(needed, target)
        probe(target, directory=not listing.is_file)
        return target, needed, free_space(target)
    assert isinstance(listing, DiskListing)  # the two listings there are
    if is_remote(out):
        key, found = upload_key(listing.found, os.fspath(out)), listing.found
        names = (
            [path.relative_to(found.root).as_posix() for path in found.root.rglob("*")] if found.is_directory else []
        )
        store_writing.refused_upload(names, key, is_file=not found.is_directory, force=force, options=options)
        return key, space_needed(found, finished, link=False), None
    local = output_path(listing.found.root, out)
    preflight(listing.found, finished, local, force=force, link=link)
    probe(local, directory=listing.found.is_directory)
    return local, space_needed(listing.found, finished, link=link), free_space(local)
