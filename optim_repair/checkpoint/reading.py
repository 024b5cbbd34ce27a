"""Reading every optimizer under a checkpoint argument into one inventory: one loop over any listing.

A ``Listing`` is what one listing found under the argument, on a disk (``DiskListing``, over ``discover``'s walk)
or in a store (``stored.StoredCheckpoint``, over one listing of its objects), and reads each file it found, each
by its format's reader. ``read_parsed`` reads a checkpoint from any listing, ``model_weights`` a model (``--model``);
neither knows where the bytes are.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import BinaryIO, Literal, Protocol

from optim_repair.checkpoint.discovery import Discovery, Entry, discover, model_only
from optim_repair.errors import InputError, NotATorchFile, OutOfMemory, UnsafeInputError, UsageError
from optim_repair.formats.dcp import DcpMetadata, read_dcp
from optim_repair.formats.deepspeed_universal import member_of, read_universal, universal_roots
from optim_repair.formats.planned import Parsed
from optim_repair.formats.registry import Role, role_of
from optim_repair.formats.safetensors import joined_shards, read_weights
from optim_repair.formats.torchfile import TorchFile, open_torch_file, read_inventory
from optim_repair.records.inventory import CheckpointInventory, FileInventory, Skipped, WeightMap
from optim_repair.records.traffic import Traffic
from optim_repair.storage.disk import open_regular

LIGHTNING_META = "meta.pt"
"""What Lightning's FSDPStrategy writes beside the ``.metadata`` of its sharded checkpoint (its own state)."""
NO_OPTIMIZER = "holds no optimizer state (no dict with 'state' and 'param_groups')"
"""Why a torch file given as the checkpoint is none: it holds neither optimizer state nor model weights."""


@dataclass(frozen=True)
class Listed:
    """One thing a listing found that reading looks at: a DCP checkpoint, a torch or safetensors file, or a file
    that is not regular."""

    rel: str
    """Its path relative to the argument, with ``/`` (``""``: the argument itself)."""
    role: Role
    unread: str | None = None
    """Why it is not read (a link read where it leads, a FIFO), or None."""


class Listing(Protocol):
    """What one listing found under a checkpoint argument, and how each of its files is read."""

    @property
    def root(self) -> str:
        """The argument, for messages."""

    @property
    def is_file(self) -> bool:
        """Whether the argument is one file (a torch file, or a safetensors file given as a model)."""

    @property
    def local(self) -> Path:
        """Where its files are on this machine (a store's: where they are fetched to), as the plan reads them."""

    def named(self, rel: str) -> str:
        """The path or URL of ``rel``, for messages."""

    def listed(self) -> Iterable[Listed]:
        """For a directory: its DCP checkpoints, then every torch, safetensors and irregular file outside them,
        in the listing's order."""

    def read_dcp(self, rel: str, name: str, keep: dict[str, DcpMetadata] | None) -> FileInventory:
        """The DCP checkpoint ``rel``, named ``name`` (``keep``: its metadata kept, for a writer)."""

    def read_torch(self, rel: str, name: str, keep: dict[str, TorchFile]) -> FileInventory:
        """The torch file ``rel`` (``""``: the argument), named ``name``, kept in ``keep`` when it holds optimizers."""

    def parse_torch(self, rel: str) -> TorchFile:
        """The torch file ``rel`` parsed, no tensor bytes read (a DeepSpeed universal checkpoint's files)."""

    def read_safetensors(self, rel: str, name: str) -> WeightMap:
        """The weights the safetensors file ``rel`` describes."""

    def reader(self, rel: str) -> Callable[[], BinaryIO]:
        """Opens the file ``rel`` (``""``: the argument) to read any of its bytes, nothing kept between reads."""

    def others(self) -> Iterator[tuple[str, int]]:
        """For a directory: every regular file no reader parses (outside its DCP checkpoints, neither a torch nor a
        safetensors file), with its size."""

    def weights_beside(self) -> tuple[WeightMap, ...]:
        """For a torch file: the shapes the safetensors files beside it give (HF's ``model.safetensors``)."""

    def model_only(self) -> str:
        """Why the argument, a file of model weights, is no checkpoint, and where its optimizer usually is."""

    def unwalked(self) -> tuple[str, ...]:
        """The linked directories the listing did not walk (a store has none)."""

    def finished(self, inventory: CheckpointInventory) -> CheckpointInventory:
        """``inventory`` with what the listing knows of links (a store knows none)."""

    def traffic(self) -> Traffic | None:
        """The requests and bytes reading took from a store (None on a disk)."""

    def check_unchanged(self) -> None:
        """Raise ``InputError`` when what was read changed while it was read (a run still saving it)."""


def read_parsed(listing: Listing, *, keep: bool = True) -> tuple[CheckpointInventory, Parsed]:
    """The inventory of every optimizer the listing found, and what was parsed to make it (``keep``: for a
    writer; without it, nothing is kept, and a DCP ``.metadata`` is summarized as it is read, in memory that
    does not grow with its chunks)."""
    torch_files: dict[str, TorchFile] = {}
    dcp: dict[str, DcpMetadata] | None = {} if keep else None
    try:
        inventory = _read(listing, torch_files, dcp)
    except PermissionError as exc:
        raise InputError("cannot read (permission denied)", path=str(exc.filename)) from exc
    except MemoryError:
        raise OutOfMemory(path=listing.root) from None
    return inventory, Parsed(torch_files, dcp or {})


def _read(
    listing: Listing, torch_files: dict[str, TorchFile], dcp: dict[str, DcpMetadata] | None
) -> CheckpointInventory:
    root = listing.root
    if listing.is_file:
        if role_of(root) == "safetensors":
            raise InputError(listing.model_only(), path=root)
        inventory = listing.read_torch("", root, torch_files)
        if not inventory.optimizers:
            raise InputError(listing.model_only() if inventory.weights else NO_OPTIMIZER, path=root)
        return CheckpointInventory(root, "torch", False, (inventory,), weights=listing.weights_beside())
    found = list(listing.listed())
    files = [listing.read_dcp(item.rel, item.rel, dcp) for item in found if item.role == "dcp"]
    skipped: list[Skipped] = []
    weights: list[WeightMap] = []
    universal = universal_roots(item.rel for item in found if item.role == "torch" and item.unread is None)
    members: dict[str, list[str]] = {root: [] for root in universal}
    for item in found:
        if item.role == "dcp":
            continue
        if item.role == "torch" and item.unread is None and (within := member_of(item.rel, universal)) is not None:
            members[within].append(item.rel)  # read per parameter, below
        elif item.unread is not None:
            skipped.append(Skipped(item.rel, item.unread))
        elif item.role == "safetensors":
            try:
                weights.append(listing.read_safetensors(item.rel, item.rel))
            except InputError as exc:
                skipped.append(Skipped(item.rel, exc.reason))
        elif item.role == "torch":
            read = partial(listing.read_torch, item.rel, item.rel, torch_files)
            try:
                read_torch_file(read, item.rel, root, files, skipped, weights)
            except UsageError as exc:  # a legacy-format file in a store
                skipped.append(Skipped(item.rel, exc.reason))
    listed = {item.rel for item in found}
    for within, rels in members.items():
        files.append(read_universal(listing.parse_torch, within, rels, listed, listing.named))
    check_found(files, skipped, root, listing.unwalked())
    dcp_only = files and all(file.format == "dcp" for file in files) and any(item.role == "dcp" for item in found)
    fmt: Literal["torch", "dcp"] = "dcp" if dcp_only else "torch"
    joined = joined_shards(weights, root)
    return listing.finished(CheckpointInventory(root, fmt, True, tuple(files), tuple(skipped), joined))


_DEEPSPEED = "deepspeed."
_TRAINER_ARGUMENTS = ("training_args.bin", "transformers.")
"""The HF Trainer's arguments: the name it saves them under, and the package whose classes they pickle."""


def skipped_file(rel: str, exc: InputError) -> Skipped:
    """A file not read: one that names DeepSpeed's classes is ZeRO state, reported as such; the HF Trainer's
    ``training_args.bin`` (its ``TrainingArguments``) is what it is; one that names other code is unsafe; one that
    is no torch file at all is just skipped."""
    if not isinstance(exc, UnsafeInputError):
        return Skipped(rel, exc.reason)
    name, package = _TRAINER_ARGUMENTS
    if rel.rpartition("/")[2] == name and (exc.global_name or "").startswith(package):
        return Skipped(rel, f"the HF Trainer's arguments ({exc.global_name}): not optimizer state, and never read")
    if (exc.global_name or "").startswith(_DEEPSPEED):
        reason = (
            f"DeepSpeed ZeRO partitioned state (it names {exc.global_name}): per-parameter entries do not apply; "
            "DeepSpeed's load_checkpoint resumes it"
        )
        return Skipped(rel, reason, "deepspeed-zero")
    return Skipped(rel, exc.reason, "unsafe")


def read_torch_file(
    read: Callable[[], FileInventory],
    rel: str,
    root: str,
    files: list[FileInventory],
    skipped: list[Skipped],
    weights: list[WeightMap],
) -> None:
    """Read one torch file of a checkpoint directory (``read`` reads it) into ``files``, or say in ``skipped`` why
    not: one that names other code, is no torch file, or holds no optimizer; the model weights of one that holds
    none (``pytorch_model_fsdp.bin`` beside ``optimizer.bin``) go to ``weights``. A damaged one refuses the
    directory, which it may have held the optimizer of."""
    try:
        inventory = read()
    except (UnsafeInputError, NotATorchFile) as exc:
        skipped.append(skipped_file(rel, exc))
        return
    except InputError as exc:
        raise InputError(
            f"{exc.reason}; a damaged torch file may have held optimizer state, so {root} is not judged",
            path=exc.path,
        ) from exc
    if inventory.optimizers:
        files.append(inventory)
    else:
        skipped.append(Skipped(rel, "holds no optimizer state"))
        weights.extend(inventory.weights)


def check_found(files: list[FileInventory], skipped: list[Skipped], root: str, linked: tuple[str, ...] = ()) -> None:
    """Refuse a checkpoint directory in which no file holds an optimizer (but DeepSpeed's ZeRO state)."""
    zero = any(skip.kind == "deepspeed-zero" for skip in skipped)
    if not any(file.optimizers for file in files) and not zero:
        unwalked = f"; {len(linked)} linked director(ies) not followed: {{argument}} follows them" if linked else ""
        reason = f"no optimizer state found in any file ({len(skipped)} file(s) skipped{unwalked})"
        raise InputError(reason, path=root, argument="dereference" if linked else None)


def model_weights(listing: Listing) -> tuple[WeightMap, ...]:
    """Parameter shapes from model weights (``--model``): a safetensors file, a torch file, or a directory or
    prefix, found as a checkpoint directory is (``save_pretrained``'s safetensors shards, torch files holding
    weights, DCP checkpoints). A file of weights that cannot be read is an error (the model would lack its
    parameters); a torch file that is none, or names other code (``training_args.bin``), holds no weights and is
    passed over, as is every other file (``model.safetensors.index.json``: the shards' own headers give the
    shapes)."""
    try:
        return _model_weights(listing)
    except MemoryError:
        raise OutOfMemory(path=listing.root) from None


def _model_weights(listing: Listing) -> tuple[WeightMap, ...]:
    root = listing.root
    if listing.is_file:
        if role_of(root) == "safetensors":
            return (listing.read_safetensors("", root),)
        weights = listing.read_torch("", root, {}).weights
        if not weights:
            raise InputError("holds no mapping of parameter names to tensors (the model weights)", path=root)
        return weights
    found: list[WeightMap] = []
    for item in listing.listed():
        name = listing.named(item.rel)
        if item.unread is not None:
            continue
        if item.role == "dcp":
            found.extend(listing.read_dcp(item.rel, name, None).weights)
        elif item.role == "safetensors":
            found.append(listing.read_safetensors(item.rel, name))
        elif item.role == "torch":
            try:
                found.extend(listing.read_torch(item.rel, name, {}).weights)
            except (UnsafeInputError, NotATorchFile, UsageError):
                continue
    if not found:
        raise InputError(
            "holds no model weights (no safetensors file, torch file of weights or DCP checkpoint)", path=root
        )
    return joined_shards(found, root)


class DiskListing:
    """What ``discover`` found under a local argument, read from the disk."""

    def __init__(self, found: Discovery) -> None:
        self.found = found

    @property
    def root(self) -> str:
        return str(self.found.root)

    @property
    def is_file(self) -> bool:
        return not self.found.is_directory

    @property
    def local(self) -> Path:
        return self.found.target

    def named(self, rel: str) -> str:
        return str(self.found.root / rel) if rel else str(self.found.root)

    def _path(self, rel: str) -> Path:
        return self.local / rel if rel else self.local

    def listed(self) -> Iterator[Listed]:
        for entry in self.found.entries:
            if entry.role == "dcp":
                yield Listed(entry.rel, "dcp", None if entry.read_through else "a link, not read")
            elif entry.role == "special":
                yield Listed(entry.rel, "special", f"is {entry.kind}, not a regular file")
            elif entry.role in ("torch", "safetensors"):
                yield Listed(entry.rel, entry.role, None if entry.read_through else self._unread_link(entry))

    def _unread_link(self, entry: Entry) -> str:
        """Why a link to a torch or safetensors file is not read: it reaches no regular file, or the file it
        reaches inside the checkpoint, which is read there."""
        if entry.kind:
            return f"is {entry.kind}, not a regular file"
        target = os.path.relpath(os.path.realpath(self._path(entry.rel)), os.path.realpath(self.found.target))
        return f"is a link to {Path(target).as_posix()}, read there"

    def read_dcp(self, rel: str, name: str, keep: dict[str, DcpMetadata] | None) -> FileInventory:
        inventory = read_dcp(self._path(rel), name, keep=keep)
        return replace(inventory, writer="lightning") if (self._path(rel) / LIGHTNING_META).is_file() else inventory

    def read_torch(self, rel: str, name: str, keep: dict[str, TorchFile]) -> FileInventory:
        return read_inventory(self._path(rel), rel, name, keep=keep)

    def parse_torch(self, rel: str) -> TorchFile:
        return open_torch_file(self._path(rel), rel)

    def read_safetensors(self, rel: str, name: str) -> WeightMap:
        return read_weights(self._path(rel), name)

    def reader(self, rel: str) -> Callable[[], BinaryIO]:
        return partial(open_regular, self._path(rel), self.named(rel))

    def others(self) -> Iterator[tuple[str, int]]:
        for entry in self.found.entries:
            if entry.role == "file" and entry.dcp is None and entry.read_through:
                yield entry.rel, self._path(entry.rel).stat().st_size

    def weights_beside(self) -> tuple[WeightMap, ...]:
        """Shapes from the safetensors files next to a file argument; a damaged one is passed over (only a source
        of shapes, no reason to refuse the file)."""
        weights = []
        for neighbour in self.found.neighbours:
            try:
                weights.append(read_weights(neighbour, neighbour.name))
            except InputError:
                continue
        return tuple(weights)

    def model_only(self) -> str:
        return model_only(self.found.target)

    def unwalked(self) -> tuple[str, ...]:
        return self.found.linked_directories()

    def finished(self, inventory: CheckpointInventory) -> CheckpointInventory:
        return replace(inventory, links_outside=self.found.links_outside(), dereference=self.found.dereference)

    def traffic(self) -> None:
        return None

    def check_unchanged(self) -> None:
        self.found.check_unchanged()


def disk_model(path: Path) -> DiskListing:
    """The model weights at ``path`` (a file or directory; the argument is the one link that is followed)."""
    if not path.exists():
        raise InputError("no such file or directory (the model weights)", path=str(path))
    if path.is_dir():
        return DiskListing(discover(path))
    target = Path(os.path.realpath(path))
    return DiskListing(Discovery(path, target, False, (Entry("", role_of(path.name)),), (), False, ()))
