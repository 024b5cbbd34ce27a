"""Repairing checkpoints in object storage (``s3://``) where they are, by server-side copies.

A repair writes into an empty prefix, as torch's own writer commits: a marker first, then a server-side copy of
every object the repair does not change, then the new shard, and each ``.metadata`` last. Until that last
write no DCP reader accepts the prefix; on any failure or ending signal the run deletes what it wrote, and a run
stopped harder (SIGKILL, a lost machine) leaves its marker, so that the next run into that prefix removes what
it left. Copies are proven by the store's CRC32 of the whole object (or its MD5 ETag) against the original's;
what this run uploads is checked against the CRC32 the store computed on receipt.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import replace
from functools import partial
from pathlib import Path, PurePosixPath
from typing import TypeVar

from optim_repair import signals
from optim_repair.checkpoint.adapters import PlannedDcp, PlannedTorchFile
from optim_repair.checkpoint.planning import FinishedPlan
from optim_repair.checkpoint.remote_reading import RemoteCheckpoint, is_metadata, members
from optim_repair.checkpoint.remote_torch import spliced_copy
from optim_repair.errors import InputError, ObjectExists, OutputError, Remedy, UsageError, VerificationError
from optim_repair.formats.dcp.verifier import verify_planned_dcp
from optim_repair.formats.dcp.writer import write_planned_dcp
from optim_repair.progress import Meter, Reporter
from optim_repair.records.traffic import Traffic
from optim_repair.records.verification import Verification
from optim_repair.storage.s3 import CHANGED, Copied, S3Store, S3Url, StoredObject, crc32_of, parse_url

_Result = TypeVar("_Result")
MARKER = ".optim-repair-incomplete"
"""The object a repair writes first into its output prefix and deletes last: a prefix holding it was left by a
run that did not finish."""


class _Written:
    """The objects this run has written into the output prefix, which it deletes if it does not finish. A key is
    recorded before its write begins (a long copy is not held up by the ending signals), and forgotten when the
    write found an object there: that one is another writer's."""

    def __init__(self, store: S3Store, url: S3Url) -> None:
        self.store, self.url = store, url
        self.keys: list[str] = []

    def writing(self, key: str, write: Callable[[], _Result]) -> _Result:
        self.keys.append(key)
        try:
            return write()
        except ObjectExists:
            self.keys.remove(key)
            raise

    def put(self, name: str, path: Path) -> Copied:
        key = self.url.object(name)
        return self.writing(key, lambda: self.store.put_file(key, path, path.stat().st_size))

    def copy(self, source: S3Url, name: str, stored: StoredObject) -> Copied:
        key = self.url.object(name)
        return self.writing(key, lambda: self.store.copy(source.object(name), stored, key, source_bucket=source.bucket))


def _abort_left_uploads(store: S3Store, prefix: str, notice: Callable[[str], None]) -> None:
    aborted = store.abort_uploads(prefix)
    if aborted:
        notice(f"aborted {aborted} unfinished uploads a stopped run left at {store.where(prefix)}")


def _claim(store: S3Store, key: str, force: bool, notice: Callable[[str], None]) -> None:
    """Make sure no object is at ``key``, where one object is to be written: one there is refused, or with
    ``force`` deleted first; unfinished uploads to it are aborted."""
    _abort_left_uploads(store, key, notice)
    if "" in store.listing(key):
        if not force:
            raise OutputError("already exists", path=store.where(key), remedy=Remedy("force", note=" to replace it"))
        store.delete([key])


def _clear(store: S3Store, url: S3Url, force: bool, notice: Callable[[str], None]) -> None:
    """Make sure the output prefix is empty: what a stopped run left there (its marker, and no metadata beside
    it) is deleted; anything else is refused, or with ``force`` deleted first (a store cannot rename a copy
    into place: the old one is gone before the new one is whole)."""
    _abort_left_uploads(store, url.prefix, notice)
    existing = store.listing(url.prefix)
    if not existing:
        return
    left = MARKER in existing and not any(is_metadata(name) for name in existing)
    if not (left or force):
        raise OutputError("already holds objects", path=str(url), remedy=Remedy("force", note=" to replace them"))
    if left:
        notice(f"removing the {len(existing)} objects a stopped run left at {url}")
    store.delete(url.object(name) for name in existing)


def write_remote(
    remote: RemoteCheckpoint,
    finished: FinishedPlan,
    out: str,
    *,
    force: bool,
    read_back: bool,
    reporter: Reporter,
) -> tuple[Verification, Traffic]:
    """Write the repaired copy of ``remote`` to the prefix ``out`` of a store, proven as the module says; with
    ``read_back``, every copy is also read back and compared byte for byte."""
    if not out.startswith("s3://"):
        raise UsageError("a checkpoint in object storage is written to object storage (s3://...) in this version")
    target_url = parse_url(out)
    source = remote.url.prefix
    if target_url.bucket == remote.url.bucket and (
        target_url.prefix.startswith(source) or source.startswith(target_url.prefix)
    ):
        raise UsageError(f"{out} holds the checkpoint or lies inside it; write the copy to a prefix beside it")
    target = remote.store.sibling(target_url.bucket)
    if remote.is_file:
        return _write_file(
            remote, finished, target, target_url, force=force, read_back=read_back, notice=reporter.notice
        )
    _clear(target, target_url, force, reporter.notice)
    written = _Written(target, target_url)
    with tempfile.TemporaryDirectory(prefix="optim-repair-staged-") as staging:
        try:
            verification = _write(remote, finished, Path(staging), written, read_back, reporter)
        except BaseException:
            with signals.held():
                target.delete(written.keys)
            raise
    return verification, remote.store.traffic()


def _write(
    remote: RemoteCheckpoint,
    finished: FinishedPlan,
    staging: Path,
    written: _Written,
    read_back: bool,
    reporter: Reporter,
) -> Verification:
    marker = staging / MARKER
    marker.write_text(f"optim-repair is writing a repaired copy of {remote.url} here\n")
    written.put(MARKER, marker)
    verification, staged = _stage(remote, finished, staging / "copy")
    spliced = {
        name: planned
        for name, planned in finished.files.items()
        if isinstance(planned, PlannedTorchFile) and planned.changes_anything
    }
    copies = [
        (name, stored)
        for name, stored in remote.listing.items()
        if name not in staged and name not in spliced and name != MARKER
    ]
    total = sum(stored.size for _, stored in copies) + sum(path.stat().st_size for path in staged.values())
    meter = Meter(reporter.progress, total)

    def copy(item: tuple[str, StoredObject]) -> tuple[str, int]:
        name, stored = item
        copied = written.copy(remote.url, name, stored)
        return _prove(remote, written, name, stored, copied, read_back), stored.size

    proofs = set()
    with contextlib.closing(remote.store.each(copy, copies)) as done:
        for proof, size in done:
            proofs.add(proof)
            meter.writing(size)
    for name, planned in spliced.items():
        key = written.url.object(name)
        target = (written.store, key)
        verification += written.writing(
            key, partial(spliced_copy, remote, name, planned, target, staging / "spliced", read_back=read_back)
        )
        proofs.add("read back" if read_back else "S3 CRC32")
        meter.writing(remote.listing[name].size)
    _upload(written, staged, meter)
    return replace(verification, proof=" and ".join(sorted(proofs)) or None)


def _upload(written: _Written, files: Mapping[str, Path], meter: Meter) -> None:
    """Upload ``files`` (by their names under the output prefix), every ``.metadata`` after every other file (the
    commit, as torch's writer makes it), each checked against the CRC32 the store computed on receipt; then
    delete the marker."""

    def put(name: str) -> int:
        path = files[name]
        answer = written.put(name, path)
        if answer.crc32 is not None and answer.crc32 != crc32_of(path):
            raise VerificationError("the store holds other bytes than were sent", path=written.url.named(name))
        return path.stat().st_size

    names = sorted(files, key=is_metadata)
    commits = [name for name in names if is_metadata(name)]
    with contextlib.closing(written.store.each(put, [name for name in names if not is_metadata(name)])) as done:
        for size in done:
            meter.writing(size)
    for name in commits:
        meter.writing(put(name))
    written.store.delete([written.url.object(MARKER)])


def upload_copy(
    copy: Path, out: str, *, force: bool, profile: str | None, endpoint_url: str | None, reporter: Reporter
) -> Traffic:
    """Upload ``copy`` (a verified repaired copy: a file, or a directory) to ``out`` in a store: a file to that
    key, never over one that exists; a directory into an empty prefix, as ``write_remote`` commits one."""
    url = parse_url(out)
    store = S3Store(url.bucket, profile=profile, endpoint_url=endpoint_url)
    if copy.is_file():
        _claim(store, url.key, force, reporter.notice)
        answer = store.put_file(url.key, copy, copy.stat().st_size)
        if answer.crc32 is not None and answer.crc32 != crc32_of(copy):
            store.delete([url.key])
            raise VerificationError("the store holds other bytes than were sent", path=out)
        return store.traffic()
    _clear(store, url, force, reporter.notice)
    written = _Written(store, url)
    files = {path.relative_to(copy).as_posix(): path for path in sorted(copy.rglob("*")) if path.is_file()}
    marker = copy.parent / f"{copy.name}{MARKER}"
    try:
        marker.write_text("optim-repair is writing a repaired copy here\n")
        written.put(MARKER, marker)
        _upload(written, files, Meter(reporter.progress, sum(path.stat().st_size for path in files.values())))
    except BaseException:
        with signals.held():
            store.delete(written.keys)
        raise
    finally:
        marker.unlink(missing_ok=True)
    return store.traffic()


def _write_file(
    remote: RemoteCheckpoint,
    finished: FinishedPlan,
    target: S3Store,
    url: S3Url,
    *,
    force: bool,
    read_back: bool,
    notice: Callable[[str], None],
) -> tuple[Verification, Traffic]:
    """The repaired copy of the torch file ``remote`` as one new object (``url``, or the file's name under it when
    it ends in a slash), which appears whole or not at all."""
    key = url.object(PurePosixPath(remote.url.key).name) if url.key.endswith("/") or not url.key else url.key
    _claim(target, key, force, notice)
    planned = finished.files[""]
    assert isinstance(planned, PlannedTorchFile)  # the adapter of a torch file
    with tempfile.TemporaryDirectory(prefix="optim-repair-staged-") as staging:
        verification = spliced_copy(remote, "", planned, (target, key), Path(staging) / "spliced", read_back=read_back)
    return replace(verification, proof="read back" if read_back else "S3 CRC32"), remote.store.traffic()


def _stage(remote: RemoteCheckpoint, finished: FinishedPlan, staging: Path) -> tuple[Verification, dict[str, Path]]:
    """Write what the repair changes into ``staging`` and prove it there against the original's metadata (every
    original byte, found through the new metadata, must lie where it lay, in the copy of its own shard)."""
    proven = Verification(0, 0)
    staged: dict[str, Path] = {}
    for rel, planned in finished.files.items():
        if not isinstance(planned, PlannedDcp):
            continue  # a torch file, spliced
        src = remote.mirror / rel if rel else remote.mirror
        dest = staging / rel if rel else staging
        dest.mkdir(parents=True, exist_ok=True)
        taken = members(remote.listing, rel).keys()
        write_planned_dcp(src, planned.planned, dest, taken=taken.__contains__)
        if not planned.changes_anything:
            continue
        proven += verify_planned_dcp(src, dest, planned.planned, whole=True)
        for path in dest.iterdir():
            staged[f"{rel}/{path.name}" if rel else path.name] = path
    return proven, staged


def _prove(
    remote: RemoteCheckpoint, written: _Written, name: str, stored: StoredObject, copied: Copied, read_back: bool
) -> str:
    """How the copy of ``name`` is proven the original's: read back, or the store's CRC32 of the whole object (or
    its MD5 ETag, for an object stored in one part) against the original's. Raises ``VerificationError``."""
    where = written.url.named(name)
    if read_back:
        if not written.store.identical(remote.url.object(name), stored, written.url.object(name), remote.store):
            raise VerificationError(f"differs from {remote.url.named(name)}", path=where)
        return "read back"
    original = remote.store.checksum(remote.url.object(name))
    if original.etag != stored.etag:
        raise InputError(CHANGED, path=remote.url.named(name))
    if original.crc32 is not None and copied.crc32 is not None:
        if original.crc32 != copied.crc32:
            raise VerificationError(f"its CRC32 differs from that of {remote.url.named(name)}", path=where)
        return "S3 CRC32"
    if "-" not in stored.etag and copied.etag == stored.etag:
        return "S3 ETag (MD5)"
    raise VerificationError(
        "the store gives no checksum to prove the copy by",
        path=where,
        remedy=Remedy("verify", "download", note=", to read it back"),
    )
