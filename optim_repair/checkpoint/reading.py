"""Reading every optimizer under a checkpoint argument, following the discovery list, into one inventory."""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Literal

from optim_repair.checkpoint.discovery import Discovery, Entry, discover, model_only
from optim_repair.errors import InputError, NotATorchFile, UnsafeInputError
from optim_repair.formats.dcp import DcpMetadata, read_dcp
from optim_repair.formats.planned import Parsed
from optim_repair.formats.registry import role_of
from optim_repair.formats.safetensors import read_weights
from optim_repair.formats.torchfile import TorchFile, read_inventory
from optim_repair.records.inventory import CheckpointInventory, FileInventory, Skipped, WeightMap

NO_OPTIMIZER = "holds no optimizer state (no dict with 'state' and 'param_groups')"
"""Why a torch file given as the checkpoint is none: it holds neither optimizer state nor model weights."""


def read_parsed(found: Discovery, *, keep: bool = True) -> tuple[CheckpointInventory, Parsed]:
    """The inventory of every optimizer in what ``discover`` found, and what was parsed to make it (``keep``:
    for a writer; without it, nothing is kept, and a DCP ``.metadata`` is summarized as it is read, in memory
    that does not grow with its chunks)."""
    torch_files: dict[str, TorchFile] = {}
    dcp: dict[str, DcpMetadata] | None = {} if keep else None
    inventory = _read_discovered(found, torch_files, dcp)
    return inventory, Parsed(torch_files, dcp or {})


def _read_discovered(
    found: Discovery, torch_files: dict[str, TorchFile], dcp: dict[str, DcpMetadata] | None
) -> CheckpointInventory:
    if not found.is_directory:
        inventory = read_inventory(found.target, "", str(found.root), keep=torch_files)
        if not inventory.optimizers:
            if inventory.weights:
                raise InputError(model_only(found.target), path=str(found.root))
            raise InputError(NO_OPTIMIZER, path=str(found.root))
        return CheckpointInventory(
            str(found.root), "torch", False, (inventory,), weights=_weights_beside(found.neighbours)
        )
    try:
        return _read_directory(found, torch_files, dcp)
    except PermissionError as exc:
        raise InputError("cannot read (permission denied)", path=str(exc.filename)) from exc


def _weights_beside(neighbours: tuple[Path, ...]) -> tuple[WeightMap, ...]:
    """Parameter shapes from safetensors files next to a file argument (HF's ``model.safetensors``)."""
    weights = []
    for neighbour in neighbours:
        try:
            weights.append(read_weights(neighbour, neighbour.name))
        except InputError:
            continue  # only a source of shapes: a damaged neighbour is no reason to refuse the file
    return tuple(weights)


_DEEPSPEED = "deepspeed."


def skipped_file(rel: str, exc: InputError) -> Skipped:
    """A file not read: one that names DeepSpeed's classes is ZeRO state, reported as such; one that names
    other code is unsafe; one that is no torch file at all is just skipped."""
    if not isinstance(exc, UnsafeInputError):
        return Skipped(rel, exc.reason)
    if (exc.global_name or "").startswith(_DEEPSPEED):
        reason = (
            f"DeepSpeed ZeRO partitioned state (it names {exc.global_name}): per-parameter entries do not apply; "
            "DeepSpeed's load_checkpoint resumes it"
        )
        return Skipped(rel, reason, "deepspeed-zero")
    return Skipped(rel, exc.reason, "unsafe")


def read_torch_file(
    read: Callable[[], FileInventory], rel: str, root: str, files: list[FileInventory], skipped: list[Skipped]
) -> None:
    """Read one torch file of a checkpoint directory (``read`` reads it) into ``files``, or say in ``skipped`` why
    not: one that names other code, is no torch file, or holds no optimizer. A damaged one refuses the directory,
    which it may have held the optimizer of."""
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


def check_found(files: list[FileInventory], skipped: list[Skipped], root: str, linked: tuple[str, ...] = ()) -> None:
    """Refuse a checkpoint directory in which no file holds an optimizer (but DeepSpeed's ZeRO state)."""
    zero = any(skip.kind == "deepspeed-zero" for skip in skipped)
    if not any(file.optimizers for file in files) and not zero:
        unwalked = f"; {len(linked)} linked director(ies) not followed: {{argument}} follows them" if linked else ""
        reason = f"no optimizer state found in any file ({len(skipped)} file(s) skipped{unwalked})"
        raise InputError(reason, path=root, argument="dereference" if linked else None)


def _read_directory(
    found: Discovery, torch_files: dict[str, TorchFile], dcp: dict[str, DcpMetadata] | None
) -> CheckpointInventory:
    root = found.root
    files = [read_dcp(found.path(entry), entry.rel, keep=dcp) for entry in found.with_role("dcp")]
    skipped: list[Skipped] = []
    weights: list[WeightMap] = []
    for entry in found.entries:
        if entry.role in ("torch", "safetensors") and not entry.read_through:
            skipped.append(Skipped(entry.rel, _unread_link(found, entry)))
        elif entry.role == "safetensors":
            try:
                weights.append(read_weights(found.path(entry), entry.rel))
            except InputError as exc:
                skipped.append(Skipped(entry.rel, exc.reason))
        elif entry.role == "special":
            skipped.append(Skipped(entry.rel, f"is {entry.kind}, not a regular file"))
        elif entry.role == "torch":
            read = partial(read_inventory, found.path(entry), entry.rel, entry.rel, keep=torch_files)
            read_torch_file(read, entry.rel, str(root), files, skipped)
    check_found(files, skipped, str(root), found.linked_directories())
    dcp_only = files and all(file.format == "dcp" for file in files) and any(found.with_role("dcp"))
    fmt: Literal["torch", "dcp"] = "dcp" if dcp_only else "torch"
    return CheckpointInventory(
        str(root), fmt, True, tuple(files), tuple(skipped), tuple(weights), found.links_outside(), found.dereference
    )


def _unread_link(found: Discovery, entry: Entry) -> str:
    """Why a link to a torch or safetensors file is not read: it reaches no regular file, or the file it
    reaches inside the checkpoint, which is read there."""
    if entry.kind:
        return f"is {entry.kind}, not a regular file"
    target = os.path.relpath(os.path.realpath(found.path(entry)), os.path.realpath(found.target))
    return f"is a link to {Path(target).as_posix()}, read there"


def read_model_weights(path: Path) -> tuple[WeightMap, ...]:
    """Parameter shapes from model weights: a safetensors file, a torch file, or a directory, found as a
    checkpoint directory is (``save_pretrained``'s safetensors shards, torch files holding weights, DCP)."""
    if not path.exists():
        raise InputError("no such file or directory (the model weights)", path=str(path))
    if path.is_dir():
        return _model_directory(discover(path))
    target = Path(os.path.realpath(path))  # the argument is the one link that is followed
    if role_of(path.name) == "safetensors":
        return (read_weights(target, str(path)),)
    inventory = read_inventory(target, str(path), str(path))
    if not inventory.weights:
        raise InputError("holds no mapping of parameter names to tensors (the model weights)", path=str(path))
    return inventory.weights


def _model_directory(found: Discovery) -> tuple[WeightMap, ...]:
    """The weights of every safetensors file, torch file and DCP checkpoint under a model directory. A file of
    weights that cannot be read is an error (the model would lack its parameters); a torch file that is none,
    or names other code (``training_args.bin``), holds no weights and is passed over, as is every other file
    (``model.safetensors.index.json``: the shards' own headers give the shapes)."""
    weights: list[WeightMap] = []
    for entry in found.entries:
        source = str(found.root / entry.rel)
        if not entry.read_through:
            continue
        if entry.role == "dcp":
            weights.extend(read_dcp(found.path(entry), source).weights)
        elif entry.role == "safetensors":
            weights.append(read_weights(found.path(entry), source))
        elif entry.role == "torch":
            try:
                weights.extend(read_inventory(found.path(entry), source, source).weights)
            except (UnsafeInputError, NotATorchFile):
                continue
    if not weights:
        raise InputError(
            "holds no model weights (no safetensors file, torch file of weights or DCP checkpoint)",
            path=str(found.root),
        )
    return tuple(weights)
