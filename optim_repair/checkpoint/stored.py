"""A checkpoint in object storage (``s3://``) as a ``reading.Listing``: found by one listing, read by range.

A key with a torch file's suffix is a torch file; anything else is a prefix, read as a checkpoint directory: each
prefix under it that holds ``.metadata`` is a DCP checkpoint, and each other object with a torch file's suffix is a
torch file. A DCP checkpoint's ``.metadata`` is read whole (one GET, into a temporary directory, where the DCP
reader reads it as it reads any); of its shards, only the bytes entries, by one ranged GET a shard (``dcp.save``
writes them at a shard's head). A torch file is read as a local one is, from a ``RangedObject`` that first fetches
its end (the end records and central directory: one GET from the end), then its pickle and framing records and
the local header of every record, in as few GETs as lie apart (``zipformat.reading_plan``). No tensor bytes but
``step`` values. For a copy on a disk (``download``), every object is fetched beside it, each checked against the
store's CRC32.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path, PurePosixPath
from typing import BinaryIO, cast

from optim_repair.checkpoint.discovery import model_only
from optim_repair.checkpoint.reading import LIGHTNING_META, Listed
from optim_repair.errors import (
    InputError,
    NotATorchFile,
    OutputError,
    UsageError,
    os_error_reason,
)
from optim_repair.formats.dcp import (
    SHARD_SUFFIX,
    DcpMetadata,
    display_path,
    metadata_names,
    read_dcp,
)
from optim_repair.formats.registry import is_dcp_metadata, role_of
from optim_repair.formats.safetensors import read_weights
from optim_repair.formats.torchfile import TorchFile, open_torch_file, read_inventory
from optim_repair.formats.torchfile.legacy import has_legacy_magic
from optim_repair.formats.torchfile.zipformat import ZIP_MAGIC, reading_plan
from optim_repair.records.inventory import CheckpointInventory, FileInventory, WeightMap
from optim_repair.records.steps import save_under_way, step_number
from optim_repair.records.traffic import Traffic
from optim_repair.storage.claim import MARKER
from optim_repair.storage.disk_staging import remove_stale, temporary_sibling
from optim_repair.storage.interface import Store, WritableStore
from optim_repair.storage.objects import StoredObject
from optim_repair.storage.ranged import RangedObject
from optim_repair.storage.schemes import StoreOptions, StoreUrl, open_store, parse_url

TAIL = 256 << 10
"""What the first GET of a torch file reads from its end: the end records and a central directory of about three
thousand records (a larger one is one more GET)."""
HEADER_GAP = 64 << 10
"""The local headers of records closer than this are read by one GET: it may carry the bytes of small tensors
between them, never of large ones."""


class StoredShards:
    """The shards of one DCP checkpoint in a store, as its listing gave them."""

    def __init__(self, store: Store, url: StoreUrl, rel: str, members: Mapping[str, StoredObject]) -> None:
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
class StoredCheckpoint:
    """A checkpoint in a store: one torch file, or a prefix and what one listing found under it, read as a
    ``reading.Listing``; and where its objects are fetched to on this machine."""

    url: StoreUrl
    store: WritableStore
    listing: Mapping[str, StoredObject]
    """Every object, by its name relative to the prefix (for a torch file: the file alone, named ``""``)."""
    dcp: tuple[str, ...]
    """The DCP checkpoints under the prefix, each by its path relative to it (``""``: the prefix itself)."""
    local: Path
    """Where its objects go on this machine, under the names they have in the store: each DCP ``.metadata`` as it
    is read (the DCP reader reads it there), every object when it is downloaded (``download``). Its torch files
    are parsed as if there, so that a plan made from the store writes a local copy of the download."""
    fetched: dict[str, list[tuple[int, bytes]]]
    """What was fetched of each file read by ranges, by its name: every reader of it (inspect's, the proof of a
    repair) shares it, so nothing is fetched twice."""
    neighbours: Mapping[str, StoredObject] = field(default_factory=dict)
    """For a torch file: the safetensors objects beside it, by their keys (HF's ``model.safetensors``), read for
    parameter shapes as a local file's neighbours are."""
    whole: set[str] = field(default_factory=set)
    """The objects fetched whole into ``local`` (each DCP ``.metadata`` read)."""

    @property
    def is_file(self) -> bool:
        return "" in self.listing

    @property
    def root(self) -> str:
        return str(self.url)

    def named(self, rel: str) -> str:
        return self.url.named(rel) if rel else str(self.url)

    def listed(self) -> Iterator[Listed]:
        """Its DCP checkpoints, then every torch and safetensors object outside them."""
        for rel in self.dcp:
            yield Listed(rel, "dcp")
        if "" in self.dcp:
            return
        inside = tuple(f"{rel}/" for rel in self.dcp if rel)
        for name in self.listing:
            role = role_of(name)
            if role in ("torch", "safetensors") and not name.startswith(inside):
                yield Listed(name, role)

    def read_dcp(self, rel: str, name: str, keep: dict[str, DcpMetadata] | None) -> FileInventory:
        """The DCP checkpoint ``rel``: its ``.metadata`` (or each rank's own) downloaded into ``local``, read there
        as on a disk, its shards read by range (``StoredShards``)."""
        directory = self._path(rel)
        directory.mkdir(parents=True, exist_ok=True)
        inside = members(self.listing, rel)
        names = metadata_names(inside)
        for metadata in (display_path(rel, file) for file in names):
            if metadata not in self.whole:
                with (self.local / metadata).open("wb") as target:
                    self.store.download(self.url.object(metadata), self.listing[metadata], target)
                self.whole.add(metadata)
        shards = StoredShards(self.store, self.url, rel, inside)
        inventory = read_dcp(directory, name, keep=keep, shards=shards, names=names)
        return replace(inventory, writer="lightning") if LIGHTNING_META in inside else inventory

    def read_torch(self, rel: str, name: str, keep: dict[str, TorchFile]) -> FileInventory:
        """The torch file ``rel`` by ranges: its end first, then its pickle and the local header of every record,
        in as few requests as lie apart (``zipformat.reading_plan``)."""
        return read_inventory(self._path(rel), rel, name, keep=keep, opener=self._torch_opener(rel, name))

    def parse_torch(self, rel: str) -> TorchFile:
        return open_torch_file(self._path(rel), rel, opener=self._torch_opener(rel, rel))

    def _torch_opener(self, rel: str, name: str) -> Callable[[], BinaryIO]:
        """Opens the torch file ``rel`` by ranges, what its reader will read fetched first; a legacy-format one is
        refused (``UsageError``)."""
        size = self.listing[rel].size
        if size == 0:
            raise InputError("empty file", path=name)
        opener = self.opener(rel, [(max(size - TAIL, 0), TAIL)])
        with opener() as stream:
            plan = reading_plan(stream)
            if plan is not None:
                cast(RangedObject, stream).prefetch(plan, gap=HEADER_GAP)
            stream.seek(0)
            if stream.read(len(ZIP_MAGIC)) != ZIP_MAGIC:  # its pickles' ends are found only by reading each through
                stream.seek(0)
                if not has_legacy_magic(stream):
                    raise NotATorchFile("not a torch file (no zip archive, no legacy magic number)", path=name)
                raise UsageError("is a legacy-format torch file: not read in object storage yet", path=name)
        return opener

    def read_safetensors(self, rel: str, name: str) -> WeightMap:
        return read_weights(self._path(rel), name, opener=self.opener(rel, [(0, TAIL)]))

    def weights_beside(self) -> tuple[WeightMap, ...]:
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

    def model_only(self) -> str:
        return model_only(Path(self.url.key), [])

    def unwalked(self) -> tuple[str, ...]:
        return ()

    def finished(self, inventory: CheckpointInventory) -> CheckpointInventory:
        return inventory

    def traffic(self) -> Traffic:
        return self.store.traffic()

    def check_unchanged(self) -> None:
        """Nothing to check after reading: every read named the version listed, so a change meanwhile was
        refused where it was met."""

    def size(self) -> int:
        """The bytes of all its objects."""
        return sum(item.size for item in self.listing.values())

    def _path(self, rel: str) -> Path:
        return self.local / rel if rel else self.local

    def download(self, progress: Callable[[int], None]) -> None:
        """Every object not yet fetched whole into ``local`` (a new directory, or for a torch file that file),
        ``WORKERS`` at a time, each checked against the CRC32 the store keeps of it; ``progress`` hears of each
        object's bytes. Each name was checked where it was listed (``Store.listing``): none leads outside
        ``local``."""

        def fetch(name: str) -> int:
            target = self._path(name)
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                with target.open("xb") as stream:
                    self.store.download(self.url.object(name) if name else self.url.key, self.listing[name], stream)
            except OSError as exc:
                raise OutputError(f"cannot write ({os_error_reason(exc)})", path=str(target)) from exc
            return self.listing[name].size

        for name in self.whole:
            progress(self.listing[name].size)
        left = [name for name in self.listing if name not in self.whole]
        with contextlib.closing(self.store.each(fetch, left)) as done:
            for size in done:
                progress(size)
        self.whole.update(left)

    def reader(self, rel: str) -> Callable[[], BinaryIO]:
        key, stored = self.url.object(rel) if rel else self.url.key, self.listing[rel]
        return lambda: cast(BinaryIO, RangedObject(self.store, key, stored, retain=False))

    def others(self) -> Iterator[tuple[str, int]]:
        inside = tuple(f"{rel}/" for rel in self.dcp if rel)
        if "" in self.dcp:
            return
        for name, stored in self.listing.items():
            if role_of(name) == "file" and not name.startswith(inside):
                yield name, stored.size

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


def latest_step(text: str, options: StoreOptions) -> str:
    """The newest complete step under the prefix ``text`` (``s3://bucket/run/``), as a URL: as locally, a step
    whose DCP checkpoints lack their ``.metadata``, or that holds nothing, is passed over, and so is one a repair
    is still writing (it holds a claim's marker)."""
    url = parse_url(text)
    store = open_store(url, options)
    steps: dict[str, list[tuple[str, StoredObject]]] = {}
    for name, stored in store.listing(url.prefix).items():
        step, _, inside = name.partition("/")
        steps.setdefault(step, []).append((inside, stored))
    numbered = sorted(
        (number, step) for step, held in steps.items() if (number := step_number(step)) is not None and _complete(held)
    )
    if not numbered:
        reason = "holds no complete checkpoint step (checkpoint-N, step-N, global_stepN, iter_N or epoch=E-step=S.ckpt)"
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
    if any(PurePosixPath(name).name == MARKER for name in names) or save_under_way(names):
        return False
    committed = {PurePosixPath(name).parent for name in names if is_dcp_metadata(name)}
    return all(PurePosixPath(name).parent in committed for name in names if name.endswith(SHARD_SUFFIX))


@contextlib.contextmanager
def opened(text: str, options: StoreOptions, mirror: Path | None = None) -> Iterator[StoredCheckpoint]:
    """The checkpoint ``text`` (``s3://bucket/prefix/``, or a torch file's key), listed once, its objects fetched
    under ``mirror`` (a new directory: one the caller holds, or a temporary one removed on the way out)."""
    url = parse_url(text)
    store = open_store(url, options)
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
        dcp = tuple(sorted({"" if parent == "." else parent for parent in parents}))
    with contextlib.ExitStack() as stack:
        if mirror is None:  # locked while the run lives; what a killed run left is removed by the next
            private = Path(tempfile.gettempdir()) / "optim-repair-remote"
            remove_stale(private, lambda line: None)
            mirror = stack.enter_context(temporary_sibling(private, directory=True))
        local = mirror / local_name(url)
        if "" not in listing:
            local.mkdir()
        yield StoredCheckpoint(url, store, listing, dcp, local, fetched, neighbours)


def local_name(url: StoreUrl) -> str:
    """The name a checkpoint in a store has on a disk: its last part (its bucket's name for a whole bucket)."""
    return PurePosixPath(url.key).name or url.bucket
