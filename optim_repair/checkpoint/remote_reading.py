"""Reading checkpoints in object storage (``s3://``): found by one listing, read by range, never downloaded.

A key with a torch file's suffix is a torch file; anything else is a prefix, read as a checkpoint directory: each
prefix under it that holds ``.metadata`` is a DCP checkpoint, and each other object with a torch file's suffix is a
torch file. A DCP checkpoint's ``.metadata`` is read whole (one GET, into a temporary directory, where the DCP
reader reads it as it reads any); of its shards, only the bytes entries, by one ranged GET a shard (``dcp.save``
writes them at a shard's head). A torch file is read as a local one is, from a ``RangedObject`` that first fetches
its end (the end records and central directory: one GET from the end), then its pickle and framing records and
the local header of every record, in as few GETs as lie apart (``zipformat.reading_plan``). No tensor bytes but
``step`` values.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path, PurePosixPath
from typing import BinaryIO, Literal, cast

from optim_repair.checkpoint.discovery import model_only
from optim_repair.checkpoint.reading import NO_OPTIMIZER, check_found, read_torch_file
from optim_repair.checkpoint.staging import remove_stale, temporary_sibling
from optim_repair.checkpoint.writing import free_space
from optim_repair.errors import (
    InputError,
    NotATorchFile,
    OutputError,
    Remedy,
    UnsafeInputError,
    UsageError,
    os_error_reason,
)
from optim_repair.formats.dcp import METADATA_FILE, SHARD_SUFFIX, DcpMetadata, read_dcp
from optim_repair.formats.planned import Parsed
from optim_repair.formats.registry import is_dcp_metadata, role_of
from optim_repair.formats.safetensors import read_weights
from optim_repair.formats.torchfile import TorchFile, read_inventory
from optim_repair.formats.torchfile.zipformat import ZIP_MAGIC, reading_plan
from optim_repair.progress import Meter, Reporter
from optim_repair.records.inventory import CheckpointInventory, FileInventory, Skipped, WeightMap
from optim_repair.records.steps import step_number
from optim_repair.storage.claim import MARKER
from optim_repair.storage.names import S3Url, parse_url
from optim_repair.storage.objects import StoredObject
from optim_repair.storage.ranged import RangedObject
from optim_repair.storage.s3 import S3Store

TAIL = 256 << 10
"""What the first GET of a torch file reads from its end: the end records and a central directory of about three
thousand records (a larger one is one more GET)."""
HEADER_GAP = 64 << 10
"""The local headers of records closer than this are read by one GET: it may carry the bytes of small tensors
between them, never of large ones."""


class RemoteShards:
    """The shards of one DCP checkpoint in a store, as its listing gave them."""

    def __init__(self, store: S3Store, url: S3Url, rel: str, members: Mapping[str, StoredObject]) -> None:
        """``members``: the objects of the DCP checkpoint at ``rel`` under the prefix ``url``, by their names there."""
        self._store, self._url, self._rel, self._members = store, url, rel, members

    def _stored(self, relative: str, where: str) -> tuple[str, StoredObject]:
        """The object a shard name (checked by the reader: inside the checkpoint) names, and its name there. The
        name is read as a path is on a disk, where torch's own reader finds the shard (``__0_0.distcp/`` and
        ``./__0_0.distcp`` are ``__0_0.distcp``)."""
        name = PurePosixPath(relative).as_posix()
        stored = self._members.get(name)
        if stored is None:
            raise InputError("cannot read (no such object)", path=where)
        return name, stored

    def size(self, relative: str, where: str) -> int:
        return self._stored(relative, where)[1].size

    def read(self, relative: str, ranges: Sequence[tuple[int, int]], where: str) -> Iterator[bytes]:
        name, stored = self._stored(relative, where)
        key = self._url.object(f"{self._rel}/{name}" if self._rel else name)
        return iter(self._store.ranges(key, stored, ranges))


def members(listing: Mapping[str, StoredObject], rel: str) -> dict[str, StoredObject]:
    """The objects of ``listing`` under ``rel``, by their names relative to it."""
    if not rel:
        return dict(listing)
    return {name[len(rel) + 1 :]: stored for name, stored in listing.items() if name.startswith(f"{rel}/")}


@dataclass
class RemoteCheckpoint:
    """A checkpoint in a store: one torch file, or a prefix and what one listing found under it; and a local
    directory holding the ``.metadata`` of each DCP checkpoint in it."""

    url: S3Url
    store: S3Store
    listing: Mapping[str, StoredObject]
    """Every object, by its name relative to the prefix (for a torch file: the file alone, named ``""``)."""
    dcp: tuple[str, ...]
    """The DCP checkpoints under the prefix, each by its path relative to it (``""``: the prefix itself)."""
    mirror: Path
    fetched: dict[str, list[tuple[int, bytes]]]
    """What was fetched of each file read by ranges, by its name: every reader of it (inspect's, the proof of a
    repair) shares it, so nothing is fetched twice."""
    neighbours: Mapping[str, StoredObject] = field(default_factory=dict)
    """For a torch file: the safetensors objects beside it, by their keys (HF's ``model.safetensors``), read for
    parameter shapes as a local file's neighbours are."""

    @property
    def is_file(self) -> bool:
        return "" in self.listing

    def read(self, *, keep: bool) -> tuple[CheckpointInventory, Parsed]:
        """The inventory of every optimizer in it (``keep``: with each DCP ``.metadata`` read whole and each torch
        file parsed, for a writer)."""
        kept: dict[str, DcpMetadata] = {}
        torch_files: dict[str, TorchFile] = {}
        if self.is_file:
            if role_of(self.url.key) == "safetensors":
                raise InputError(model_only(Path(self.url.key), []), path=str(self.url))
            file = self._torch_file("", torch_files)
            if not file.optimizers:
                reason = model_only(Path(self.url.key), []) if file.weights else NO_OPTIMIZER
                raise InputError(reason, path=str(self.url))
            inventory = CheckpointInventory(str(self.url), "torch", False, (file,), weights=self._weights_beside())
            return inventory, Parsed(torch_files)
        files = [self._dcp(rel, kept if keep else None) for rel in self.dcp]
        skipped: list[Skipped] = []
        weights: list[WeightMap] = []
        inside = tuple(f"{rel}/" for rel in self.dcp if rel)
        for name in self.listing:
            if "" in self.dcp or name.startswith(inside):
                continue
            if role_of(name) == "safetensors":
                try:
                    weights.append(read_weights(Path(name), name, opener=self.opener(name, [(0, TAIL)])))
                except InputError as exc:
                    skipped.append(Skipped(name, exc.reason))
            if role_of(name) != "torch":
                continue
            try:
                read_torch_file(partial(self._torch_file, name, torch_files), name, str(self.url), files, skipped)
            except UsageError as exc:  # a legacy-format file
                skipped.append(Skipped(name, exc.reason))
        check_found(files, skipped, str(self.url))
        fmt: Literal["torch", "dcp"] = "dcp" if self.dcp and all(file.format == "dcp" for file in files) else "torch"
        inventory = CheckpointInventory(str(self.url), fmt, True, tuple(files), tuple(skipped), tuple(weights))
        return inventory, Parsed(torch_files, kept)

    def _weights_beside(self) -> tuple[WeightMap, ...]:
        """Parameter shapes from the safetensors objects beside a torch file; a damaged one is passed over, as on a
        disk (only a source of shapes, no reason to refuse the file)."""
        weights = []
        for key, stored in sorted(self.neighbours.items()):
            opened = RangedObject(self.store, key, stored)
            opened.prefetch([(0, TAIL)], gap=0)
            try:
                weights.append(read_weights(Path(key), PurePosixPath(key).name, opener=partial(cast, BinaryIO, opened)))
            except InputError:
                continue
        return tuple(weights)

    def weights(self) -> tuple[WeightMap, ...]:
        """The model weights it holds (``--model``), found as in a local model file or directory: safetensors
        headers, torch files of weights, DCP checkpoints."""
        if self.is_file:
            if role_of(self.url.key) == "safetensors":
                return (read_weights(Path(self.url.key), str(self.url), opener=self.opener("", [(0, TAIL)])),)
            found = self._torch_file("", {}).weights
        else:
            found = tuple(weight for rel in self.dcp for weight in self._dcp(rel, None).weights)
            inside = tuple(f"{rel}/" for rel in self.dcp if rel)
            for name in self.listing:
                if "" in self.dcp or name.startswith(inside):
                    continue
                if role_of(name) == "safetensors":
                    found += (read_weights(Path(name), name, opener=self.opener(name, [(0, TAIL)])),)
                elif role_of(name) == "torch":
                    with contextlib.suppress(UnsafeInputError, NotATorchFile, UsageError):  # no weights there
                        found += self._torch_file(name, {}).weights
        if not found:
            raise InputError("holds no model weights (the model given)", path=str(self.url))
        return found

    def local_target(self, out: str | os.PathLike[str]) -> Path:
        """Where a local copy of it goes: ``out``, or for a torch file and an ``out`` ending in a slash, the file's
        name inside that directory, as ``cp`` does."""
        text = os.fspath(out)
        name = PurePosixPath(self.url.key).name
        return Path(text) / name if self.is_file and text.endswith(("/", os.sep)) else Path(text)

    @contextlib.contextmanager
    def downloaded(self, target: Path, *, force: bool, reporter: Reporter) -> Iterator[Path]:
        """All of it, downloaded into a temporary directory beside ``target`` (where a copy of it is to go), locked
        while the run lives and removed after it (or by the next run, after a kill): the checkpoint's path in it.
        Refused before a byte moves when ``target`` exists (without ``force``) or its file system lacks room."""
        total = sum(item.size for item in self.listing.values())
        if (target.exists() or target.is_symlink()) and not force:
            raise OutputError("already exists", path=str(target), remedy=Remedy("force", note=" to replace it"))
        if Path(os.path.abspath(target)).parent.is_dir() and total > free_space(target):
            reason = f"has {free_space(target):,} bytes free, too few to download {total:,}"
            raise OutputError(reason, path=str(target.parent))
        remove_stale(target, reporter.notice)
        with temporary_sibling(target, directory=True) as tmp:
            local = tmp / (PurePosixPath(self.url.key).name or self.url.bucket)
            reporter.notice(f"downloading {len(self.listing)} objects ({total:,} bytes) beside {target}")
            self.download(local, Meter(reporter.progress, total).writing)
            yield local

    def download(self, into: Path, progress: Callable[[int], None]) -> None:
        """Every object into the new directory ``into`` (for a torch file: into that file), ``WORKERS`` at a time,
        each checked against the CRC32 the store keeps of it; ``progress`` hears of each object's bytes. Each name
        was checked where it was listed (``S3Store.listing``): none leads outside ``into``."""

        def fetch(name: str) -> int:
            target = into / name if name else into
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                with target.open("xb") as stream:
                    self.store.download(self.url.object(name) if name else self.url.key, self.listing[name], stream)
            except OSError as exc:
                raise OutputError(f"cannot write ({os_error_reason(exc)})", path=str(target)) from exc
            return self.listing[name].size

        with contextlib.closing(self.store.each(fetch, list(self.listing))) as done:
            for size in done:
                progress(size)

    def _dcp(self, rel: str, keep: dict[str, DcpMetadata] | None) -> FileInventory:
        directory = self.mirror / rel if rel else self.mirror
        directory.mkdir(parents=True, exist_ok=True)
        metadata = f"{rel}/{METADATA_FILE}" if rel else METADATA_FILE
        with (directory / METADATA_FILE).open("wb") as target:
            self.store.download(self.url.object(metadata), self.listing[metadata], target)
        shards = RemoteShards(self.store, self.url, rel, members(self.listing, rel))
        return read_dcp(directory, rel, keep=keep, shards=shards)

    def opener(self, name: str, first: Sequence[tuple[int, int]] = ()) -> Callable[[], BinaryIO]:
        """Opens the object ``name`` by ranges, every one it opens sharing what was fetched of it (``fetched``),
        ``first`` the moment it is first opened."""
        key, stored = self.url.object(name) if name else self.url.key, self.listing[name]
        spans = self.fetched.setdefault(name, [])

        def opener() -> BinaryIO:
            opened = RangedObject(self.store, key, stored, spans)
            if not spans:
                opened.prefetch(first, gap=0)
            return cast(BinaryIO, opened)

        return opener

    def _torch_file(self, name: str, keep: dict[str, TorchFile]) -> FileInventory:
        size = self.listing[name].size
        if size == 0:
            raise InputError("empty file", path=name or str(self.url))
        opener = self.opener(name, [(max(size - TAIL, 0), TAIL)])
        with opener() as stream:
            plan = reading_plan(stream)
            if plan is not None:
                cast(RangedObject, stream).prefetch(plan, gap=HEADER_GAP)
            stream.seek(0)
            if stream.read(len(ZIP_MAGIC)) != ZIP_MAGIC:  # its pickle is bounded by mapping it, as on a disk
                reason = "is no zip archive (a legacy-format torch file?): not read in object storage yet"
                raise UsageError(reason, path=name or str(self.url))
        source = name or str(self.url)
        return read_inventory(Path(name or self.url.key), name, source, keep=keep, opener=opener)


def latest_step(text: str, *, profile: str | None, endpoint_url: str | None) -> str:
    """The newest complete step under the prefix ``text`` (``s3://bucket/run/``), as a URL: as locally, a step
    whose DCP checkpoints lack their ``.metadata``, or that holds nothing, is passed over, and so is one a repair
    is still writing (it holds a claim's marker)."""
    url = parse_url(text)
    store = S3Store(url.bucket, profile=profile, endpoint_url=endpoint_url)
    steps: dict[str, list[tuple[str, StoredObject]]] = {}
    for name, stored in store.listing(url.prefix).items():
        step, _, inside = name.partition("/")
        steps.setdefault(step, []).append((inside, stored))
    numbered = sorted(
        (number, step) for step, held in steps.items() if (number := step_number(step)) is not None and _complete(held)
    )
    if not numbered:
        reason = "holds no complete checkpoint step (checkpoint-N, step-N, global_stepN or epoch=E-step=S.ckpt)"
        raise InputError(reason, path=str(url))
    step = numbered[-1][1]
    whole = url.named(step)
    return whole if not any(inside for inside, _ in steps[step]) else f"{whole}/"


def _complete(held: Sequence[tuple[str, StoredObject]]) -> bool:
    """Whether a step's objects (by their names inside it; ``""``: the step is one object) are written to the
    end: a non-empty object, or objects among which no DCP checkpoint lacks its ``.metadata`` and no claim's
    marker lies."""
    if any(inside == "" for inside, _ in held):
        return all(stored.size > 0 for _, stored in held)
    names = {inside for inside, _ in held}
    if any(PurePosixPath(name).name == MARKER for name in names):
        return False
    folders = {PurePosixPath(name).parent for name in names if name.endswith(SHARD_SUFFIX)}
    return all((folder / METADATA_FILE).as_posix().removeprefix("./") in names for folder in folders)


@contextlib.contextmanager
def opened(text: str, *, profile: str | None, endpoint_url: str | None) -> Iterator[RemoteCheckpoint]:
    """The checkpoint ``text`` (``s3://bucket/prefix/``, or a torch file's key), listed once; its local directory
    is removed on the way out."""
    url = parse_url(text)
    store = S3Store(url.bucket, profile=profile, endpoint_url=endpoint_url)
    fetched: dict[str, list[tuple[int, bytes]]] = {}
    neighbours: dict[str, StoredObject] = {}
    if role_of(url.key) in ("torch", "safetensors"):
        stored, tail = store.tail(url.key, TAIL)  # its size, ETag and end in one request
        listing, fetched[""] = {"": stored}, [(stored.size - len(tail), tail)]
        dcp: tuple[str, ...] = ()
        if role_of(url.key) == "torch":
            parent = url.key.rpartition("/")[0]
            beside = f"{parent}/" if parent else ""
            neighbours = {
                f"{beside}{name}": item
                for name, item in store.listing(beside, children=True).items()
                if role_of(name) == "safetensors"
            }
    else:
        listing = store.listing(url.prefix)
        if not listing:
            raise InputError("holds no objects", path=str(url))
        parents = (PurePosixPath(name).parent.as_posix() for name in listing if is_dcp_metadata(name))
        dcp = tuple(sorted("" if parent == "." else parent for parent in parents))
    with tempfile.TemporaryDirectory(prefix="optim-repair-remote-") as mirror:
        yield RemoteCheckpoint(url, store, listing, dcp, Path(mirror), fetched, neighbours)
