"""Repairing checkpoints in object storage (``s3://``, ``gs://``) where they are, by server-side copies.

A repair writes into an empty prefix, as torch's own writer commits: a server-side copy of every object the
repair does not change, then the new shard, and each ``.metadata`` last. Until that last write no DCP reader
accepts the prefix. Everything that can be refused (a splice, a staged shard's proof, an output that holds
objects without ``force``) is refused before the output is touched. The run claims the output first
(``storage.claim``: at most one run writes there, and a run deletes only what it wrote): on any failure or
ending signal it deletes what it wrote, and what a run stopped harder (SIGKILL, a lost machine) left is removed
by the next run once its lease has lapsed. Copies are proven by the checksum the store keeps of the whole object
(``WritableStore.proof``: S3's CRC-32, GCS's CRC-32C; or S3's MD5 ETag) against the original's; what this run
uploads is checked against the checksum the store computed on receipt. A torch file is spliced
(``PlannedTorchFile.splice``, proven before a byte is written; appended to the whole original where the store
composes only whole objects) and composed inside the store (``WritableStore.compose``): its checksum, derived from
the original's, proves the kept bytes unchanged, or ``read_back`` reads them back.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path, PurePosixPath
from typing import BinaryIO, NamedTuple

from optim_repair.checkpoint.planning import FinishedPlan
from optim_repair.checkpoint.stored import StoredCheckpoint, members
from optim_repair.errors import (
    InputError,
    OutputError,
    Remedy,
    UsageError,
    VerificationError,
    counted,
    shown_name,
)
from optim_repair.formats.dcp import REPAIR_SHARD_PREFIX
from optim_repair.formats.dcp.adapter import PlannedDcp
from optim_repair.formats.registry import is_dcp_metadata
from optim_repair.formats.torchfile.adapter import PlannedTorchFile, Spliced
from optim_repair.progress import Meter, Reporter
from optim_repair.records.traffic import Traffic
from optim_repair.records.verification import HolderProof, Verification
from optim_repair.storage.answers import CHANGED
from optim_repair.storage.claim import MARKER, Claim, claimed, marker_key
from optim_repair.storage.disk_staging import remove_stale, temporary_sibling
from optim_repair.storage.interface import WritableStore
from optim_repair.storage.objects import Copied, StoredObject
from optim_repair.storage.schemes import StoreOptions, StoreUrl, is_remote, open_store, parse_url

_CHUNK = 8 << 20
"""What a read-back compares at a time."""
STORE_COPIES = HolderProof(unchanged_files=True)
"""What a store proves of a copy made in it: every object the repair does not write, copied whole inside the store
and proven by its checksums (``_prove``), so that the verifier of what the repair wrote does not read them."""


def _refused_early(store: WritableStore, url: StoreUrl, force: bool, ours: Collection[str]) -> None:
    """Refuse an output prefix that holds objects (without ``force``) before anything is written; where a marker
    is there, the claim decides (a stopped run's objects are cleared first)."""
    listed = store.listing(url.prefix)
    if MARKER not in listed:
        _refuse_existing(store, url, force, ours, ignore=MARKER)


def _refuse_existing(
    store: WritableStore, url: StoreUrl, force: bool, ours: Collection[str], *, ignore: str
) -> list[str]:
    """The objects under the output prefix (but this run's marker ``ignore``): refused unless ``force``, which
    deletes them, once the run holds the prefix and the whole plan is known to succeed. As on a disk, ``force``
    replaces only what looks like an earlier copy: objects the copy writes (``ours``) or a repair's new shard;
    a prefix holding anything else is no earlier copy, and is refused whatever ``force`` says."""
    existing = [name for name in store.listing(url.prefix) if name != ignore]
    if existing and not force:
        raise OutputError("already holds objects", path=str(url), remedy=Remedy("force", note=" to replace them"))
    foreign = sorted(
        name for name in existing if name not in ours and not PurePosixPath(name).name.startswith(REPAIR_SHARD_PREFIX)
    )
    if foreign:
        shown = ", ".join(shown_name(name) for name in foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise OutputError(
            f"holds {counted(len(foreign), 'object')} the copy would not write ({shown}): it is no earlier copy, and "
            "--force replaces only one; remove them yourself, or choose another {argument}",
            path=str(url),
            argument="out",
        )
    return existing


def _abort_left_uploads(
    store: WritableStore, prefix: str, notice: Callable[[str], None], *, exact: bool = False
) -> None:
    aborted = store.abort_uploads(prefix, exact=exact)
    if aborted:
        notice(f"aborted {counted(aborted, 'unfinished upload')} a stopped run left at {store.where(prefix)}")


class _Output(NamedTuple):
    """Where and how a repaired copy is written in a store: its store and URL, a local directory for what is staged,
    and the caller's choices."""

    store: WritableStore
    url: StoreUrl
    staging: Path
    force: bool
    read_back: bool
    reporter: Reporter


def write_in_store(
    source: StoredCheckpoint,
    finished: FinishedPlan,
    out: str,
    *,
    force: bool,
    read_back: bool,
    reporter: Reporter,
) -> tuple[Verification, Traffic]:
    """Write the repaired copy of ``source`` to the prefix ``out`` of a store, proven as the module says; with
    ``read_back``, every copy is also read back and compared byte for byte. Everything that can be refused is
    refused before the output is touched."""
    target_url = _target_url(source, out)
    target = source.store.sibling(target_url.bucket)
    private = Path(tempfile.gettempdir()) / "optim-repair-staged"  # the stand-in its temporaries are named for
    remove_stale(private, reporter.notice)  # what a killed run staged
    with temporary_sibling(private, directory=True) as staging:
        output = _Output(target, target_url, staging, force, read_back, reporter)
        write = _write_file if source.is_file else _write_prefix
        verification = write(source, finished, output)
    return verification, source.store.traffic()


def _target_url(source: StoredCheckpoint, out: str) -> StoreUrl:
    """Where in its store the copy of ``source`` goes: refused outside that store, and over or inside ``source``."""
    if not is_remote(out):
        raise UsageError(
            "a checkpoint in object storage is written to object storage (s3://, gs://, az://) in this version"
        )
    target_url = parse_url(out)
    if target_url.scheme != source.url.scheme:
        raise UsageError(f"a checkpoint in {source.url.scheme}:// is copied inside that store, not to {out}")
    if target_url.account != source.url.account:
        raise UsageError(
            f"{out} names its Azure account otherwise than the checkpoint does; a copy stays in the checkpoint's "
            "account, named alike on both sides"
        )
    held = source.url.prefix
    if target_url.bucket == source.url.bucket and (
        target_url.prefix.startswith(held) or held.startswith(target_url.prefix)
    ):
        raise UsageError(f"{out} holds the checkpoint or lies inside it; write the copy to a prefix beside it")
    return target_url


def _file_key(source: StoredCheckpoint, url: StoreUrl) -> str:
    """The key of the copy of the torch file ``source``: ``url``, or the file's name under it when it ends in a
    slash."""
    return url.object(PurePosixPath(source.url.key).name) if url.key.endswith("/") or not url.key else url.key


def refused_in_store(source: StoredCheckpoint, out: str, *, force: bool) -> None:
    """Refuse, as ``write_in_store`` would before writing (a dry run), a copy of ``source`` to ``out``."""
    url = _target_url(source, out)
    target = source.store.sibling(url.bucket)
    if source.is_file:
        _refuse_object(target, _file_key(source, url), force)
    else:
        _refused_early(target, url, force, set(source.listing))


def refused_upload(names: Collection[str], out: str, *, is_file: bool, force: bool, options: StoreOptions) -> None:
    """Refuse, as ``upload_copy`` would before writing (a dry run), a local copy of ``names`` uploaded to ``out``."""
    url = parse_url(out)
    store = open_store(url, options)
    if is_file:
        _refuse_object(store, url.key, force)
    else:
        _refused_early(store, url, force, names)


def _write_file(source: StoredCheckpoint, finished: FinishedPlan, output: _Output) -> Verification:
    """The repaired copy of the torch file ``source`` as one new object (``url``, or the file's name under it when
    it ends in a slash), which appears whole or not at all."""
    target, url, staging, force, read_back, reporter = output
    key = _file_key(source, url)
    planned = finished.files[""]
    assert isinstance(planned, PlannedTorchFile)  # the adapter of a torch file
    prepared = planned.splice(source.opener(""), staging / "spliced", appended=not target.composes_ranges)
    _refuse_object(target, key, force)
    with claimed(target, marker_key(key), [key, *target.scratch_keys(key)], reporter.notice) as claim:
        _abort_left_uploads(target, key, reporter.notice, exact=True)
        if _refuse_object(target, key, force):
            target.delete([key])
        claim.commit(
            lambda: claim.writing(key, lambda: _write_spliced(source, "", prepared, target, key, read_back=read_back))
        )
    return replace(prepared.proven, proof="read back" if read_back else target.pinned or target.proof)


def _refuse_object(store: WritableStore, key: str, force: bool) -> bool:
    """Whether an object is at ``key``, where one is to be written: refused unless ``force``."""
    there = "" in store.listing(key) if key.endswith("/") else store.owner(key) is not None
    if there and not force:
        raise OutputError("already exists", path=store.where(key), remedy=Remedy("force", note=" to replace it"))
    return there


def _write_prefix(source: StoredCheckpoint, finished: FinishedPlan, output: _Output) -> Verification:
    """The repaired copy of the prefix ``source`` into the prefix ``url``: the plan's files staged and proven
    locally, and every splice proven, before the output is claimed; then copies, splices and uploads, each
    ``.metadata`` last."""
    target, url, staging, force, read_back, reporter = output
    verification, staged = _stage(source, finished, staging / "copy")
    spliced = {
        name: planned.splice(source.opener(name), staging / f"spliced-{index}", appended=not target.composes_ranges)
        for index, (name, planned) in enumerate(finished.files.items())
        if isinstance(planned, PlannedTorchFile) and planned.changes_anything
    }
    verification = sum((prepared.proven for prepared in spliced.values()), verification)
    copies = [(name, stored) for name, stored in source.listing.items() if name not in staged and name not in spliced]
    ours = {*(name for name, _ in copies), *spliced, *staged}
    _refused_early(target, url, force, ours)
    planned_keys = [url.object(name) for name in (*(name for name, _ in copies), *spliced, *staged)]
    planned_keys += [scratch for name in spliced for scratch in target.scratch_keys(url.object(name))]
    with claimed(target, marker_key(url.prefix), planned_keys, reporter.notice) as claim:
        existing = _refuse_existing(target, url, force, ours, ignore=MARKER)
        _abort_left_uploads(target, url.prefix, reporter.notice)
        if existing:
            target.delete([url.object(name) for name in existing])
        proofs = _copy_all(source, target, url, claim, copies, spliced, staged, read_back, reporter)
    return replace(verification, proof=" and ".join(sorted(proofs)) or None)


def _copy_all(
    source: StoredCheckpoint,
    target: WritableStore,
    url: StoreUrl,
    claim: Claim,
    copies: Sequence[tuple[str, StoredObject]],
    spliced: Mapping[str, Spliced],
    staged: Mapping[str, Path],
    read_back: bool,
    reporter: Reporter,
) -> set[str]:
    total = sum(stored.size for _, stored in copies) + sum(path.stat().st_size for path in staged.values())
    meter = Meter(reporter.progress, total + sum(source.listing[name].size for name in spliced))

    def copy(item: tuple[str, StoredObject]) -> tuple[str, int]:
        name, stored = item
        key = url.object(name)
        copied = claim.writing(
            key, lambda: target.copy(source.url.object(name), stored, key, source_bucket=source.url.bucket)
        )
        return _prove(source, target, url, name, stored, copied, read_back), stored.size

    proofs = set()
    with contextlib.closing(source.store.each(copy, copies)) as done:
        for proof, size in done:
            proofs.add(proof)
            meter.writing(size)
    for name, prepared in spliced.items():
        key = url.object(name)
        claim.writing(key, partial(_write_spliced, source, name, prepared, target, key, read_back=read_back))
        proofs.add("read back" if read_back else target.pinned or target.proof)
        meter.writing(source.listing[name].size)
    _upload(target, url, claim, staged, meter)
    return proofs


def _upload(store: WritableStore, url: StoreUrl, claim: Claim, files: Mapping[str, Path], meter: Meter) -> None:
    """Upload ``files`` (by their names under the output prefix), every ``.metadata`` after every other file (the
    commit, as torch's writer makes it, once the claim is renewed), each checked against the CRC32 the store
    computed on receipt."""

    def put(name: str) -> int:
        path, key = files[name], url.object(name)
        answer = claim.writing(key, lambda: store.put_file(key, path, path.stat().st_size))
        if answer.checksum is not None and answer.checksum != store.file_checksum(path):
            raise VerificationError("the store holds other bytes than were sent", path=url.named(name))
        return path.stat().st_size

    names = sorted(files, key=is_dcp_metadata)
    with contextlib.closing(store.each(put, [name for name in names if not is_dcp_metadata(name)])) as done:
        for size in done:
            meter.writing(size)
    for name in names:
        if is_dcp_metadata(name):
            meter.writing(claim.commit(partial(put, name)))


def upload_copy(copy: Path, out: str, *, force: bool, options: StoreOptions, reporter: Reporter) -> tuple[Traffic, str]:
    """Upload ``copy`` (a verified repaired copy: a file, or a directory) to ``out`` in a store: a file to that
    key, never over one that exists; a directory into an empty prefix, as ``write_in_store`` commits one. Returns
    the traffic and the checksum each upload was checked by (``WritableStore.proof``)."""
    url = parse_url(out)
    store = open_store(url, options)
    if copy.is_file():
        _refuse_object(store, url.key, force)
        with claimed(store, marker_key(url.key), [url.key], reporter.notice) as claim:
            _abort_left_uploads(store, url.key, reporter.notice, exact=True)
            if _refuse_object(store, url.key, force):
                store.delete([url.key])
            answer = claim.commit(
                lambda: claim.writing(url.key, lambda: store.put_file(url.key, copy, copy.stat().st_size))
            )
            if answer.checksum is not None and answer.checksum != store.file_checksum(copy):
                raise VerificationError("the store holds other bytes than were sent", path=out)
        return store.traffic(), store.proof
    files = {path.relative_to(copy).as_posix(): path for path in sorted(copy.rglob("*")) if path.is_file()}
    _refused_early(store, url, force, files)
    with claimed(store, marker_key(url.prefix), [url.object(name) for name in files], reporter.notice) as claim:
        existing = _refuse_existing(store, url, force, files, ignore=MARKER)
        _abort_left_uploads(store, url.prefix, reporter.notice)
        if existing:
            store.delete([url.object(name) for name in existing])
        _upload(store, url, claim, files, Meter(reporter.progress, sum(path.stat().st_size for path in files.values())))
    return store.traffic(), store.proof


def _stage(source: StoredCheckpoint, finished: FinishedPlan, staging: Path) -> tuple[Verification, dict[str, Path]]:
    """Write what the repair changes into ``staging`` and prove it there against the original's metadata (every
    original byte, found through the new metadata, must lie where it lay, in the copy of its own shard)."""
    proven = Verification(0, 0)
    staged: dict[str, Path] = {}
    for rel, planned in finished.files.items():
        if not isinstance(planned, PlannedDcp):
            continue  # a torch file, spliced
        src = source.local / rel if rel else source.local
        dest = staging / rel if rel else staging
        dest.mkdir(parents=True, exist_ok=True)
        taken = members(source.listing, rel).keys()
        planned.write_views(src, dest, taken.__contains__)
        if not planned.changes_anything:
            continue
        proven += planned.verify_views(src, dest, STORE_COPIES)
        for path in dest.iterdir():
            staged[f"{rel}/{path.name}" if rel else path.name] = path
    return proven, staged


def _prove(
    source: StoredCheckpoint, target: WritableStore, url: StoreUrl, name: str, stored: StoredObject, copied: Copied,
    read_back: bool,
) -> str:  # fmt: skip
    """How the copy of ``name`` is proven the original's: read back, or the checksum the store keeps of the whole
    object against the original's (or where it keeps none, what its version tags prove, ``proven_by_tags``, or
    that it was pinned to them, ``pinned``). Raises ``VerificationError``."""
    where = url.named(name)
    if read_back:
        if not target.identical(source.url.object(name), stored, url.object(name), source.store):
            raise VerificationError(f"differs from {source.url.named(name)}", path=where)
        return "read back"
    original = source.store.checksum(source.url.object(name))
    if original.etag != stored.etag:
        raise InputError(CHANGED, path=source.url.named(name))
    if original.checksum is not None and copied.checksum is not None:
        if original.checksum != copied.checksum:
            raise VerificationError(f"its {target.proof} differs from that of {source.url.named(name)}", path=where)
        return target.proof
    by_tags = target.proven_by_tags(stored, copied) or target.pinned
    if by_tags is not None:
        return by_tags
    raise VerificationError(
        "the store gives no checksum to prove the copy by",
        path=where,
        remedy=Remedy("verify", "download", note=", to read it back"),
    )


def _write_spliced(
    source: StoredCheckpoint, name: str, spliced: Spliced, store: WritableStore, new_key: str, *, read_back: bool
) -> Copied:
    """Compose the spliced copy of the torch file ``name`` of ``source`` as the new object ``new_key`` of ``store``:
    its new head and tail around the original's kept range, copied inside the store (``WritableStore.compose``). Its
    checksum, derived from the original's, proves the kept bytes unchanged (where the store keeps one: else it was
    ``pinned``); ``read_back`` reads them back instead."""
    made = spliced.made
    key, stored = source.url.object(name) if name else source.url.key, source.listing[name]
    head, tail = spliced.head_and_tail()
    composed = store.compose(new_key, head, (source.store, key, stored), (made.start, made.end), tail,
                       source.store.checksum(key).checksum)  # fmt: skip
    where = store.where(new_key)
    if read_back:
        _read_back(store, new_key, spliced.joined, where)
    elif store.pinned is None and (composed.expected is None or composed.written.checksum is None):
        remedy = Remedy("verify", "download", note=", to read it back")
        raise VerificationError(
            f"the store gives no {store.proof} to prove the spliced copy by", path=where, remedy=remedy
        )
    elif store.pinned is None and composed.written.checksum != composed.expected:
        raise VerificationError(f"its {store.proof} is not the one its parts give", path=where)
    return composed.written


def _read_back(store: WritableStore, key: str, copy: Callable[[], BinaryIO], where: str) -> None:
    """The new object, read back in chunks, holds the bytes of the joined file ``copy`` opens."""
    stored = store.head(key)
    with copy() as expected:
        size = expected.seek(0, 2)
        if stored.size != size:
            raise VerificationError(f"holds {stored.size} bytes, not {size}", path=where)
        expected.seek(0)
        for start in range(0, size, _CHUNK):
            end = min(start + _CHUNK, size)
            if store.get_range(key, stored, start, end) != expected.read(end - start):
                raise VerificationError("its bytes are not those of the spliced copy", path=where)
