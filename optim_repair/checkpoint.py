"""Find and read every optimizer under a checkpoint argument: a file, a directory, or a DCP directory."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from optim_repair.errors import InputError, NotATorchFile, UnsafeInputError
from optim_repair.formats import dcp
from optim_repair.formats.safetensors import read_weights
from optim_repair.formats.torchfile import read_inventory
from optim_repair.inventory import CheckpointInventory, FileInventory, Skipped, WeightMap

TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
"""Files a directory argument reads as torch files (UniRL, HF Trainer, Accelerate, Lightning)."""


def relative(path: Path, root: Path) -> str:
    return "" if path == root else path.relative_to(root).as_posix()


def walk_files(root: Path) -> Iterator[Path]:
    """Every file under ``root``, in a stable order."""
    for directory, subdirectories, files in os.walk(root):
        subdirectories.sort()
        for name in sorted(files):
            yield Path(directory) / name


def _dcp_roots(root: Path) -> list[Path]:
    return [Path(d) for d, _, files in os.walk(root) if ".metadata" in files and dcp.is_dcp_directory(Path(d))]


def _without_prefix(message: str, source: str) -> str:
    prefix = f"{source}: "
    return message[len(prefix):] if message.startswith(prefix) else message


def read_checkpoint(path: Path) -> CheckpointInventory:
    """The inventory of every optimizer under ``path``. Raises InputError when there is none."""
    if not path.exists():
        raise InputError(f"{path}: no such file or directory")
    if path.is_file():
        if path.name == ".metadata" or path.suffix == ".distcp":
            raise InputError(f"{path}: part of a DCP checkpoint; pass its directory, {path.parent}")
        inventory = read_inventory(path, "", str(path))
        if not inventory.optimizers:
            raise InputError(f"{path}: holds no optimizer state (no dict with 'state' and 'param_groups')")
        return CheckpointInventory(str(path), "torch", False, (inventory,), weights=_weights_beside(path))
    if not path.is_dir():
        raise InputError(f"{path}: not a file or directory")
    try:
        return _read_directory(path)
    except PermissionError as exc:
        raise InputError(f"{exc.filename}: cannot read (permission denied)") from None


def _weights_beside(file: Path) -> tuple[WeightMap, ...]:
    """Parameter shapes from safetensors files next to a file argument (HF's ``model.safetensors``)."""
    weights = []
    for neighbour in sorted(file.parent.glob("*.safetensors")):
        try:
            weights.append(read_weights(neighbour, neighbour.name))
        except InputError:
            continue  # only a source of shapes: a damaged neighbour is no reason to refuse the file
    return tuple(weights)


def _read_directory(root: Path) -> CheckpointInventory:
    dcp_roots = _dcp_roots(root)
    files: list[FileInventory] = []
    skipped: list[Skipped] = []
    weights: list[WeightMap] = []
    for directory in dcp_roots:
        files.append(dcp.read_dcp(directory, relative(directory, root)))
    for file in walk_files(root):
        if any(directory in file.parents for directory in dcp_roots):
            continue
        rel = relative(file, root)
        if file.suffix == ".safetensors":
            try:
                weights.append(read_weights(file, rel))
            except InputError as exc:
                skipped.append(Skipped(rel, _without_prefix(str(exc), rel)))
            continue
        if file.suffix not in TORCH_SUFFIXES:
            continue
        try:
            inventory = read_inventory(file, rel, rel)
        except (UnsafeInputError, NotATorchFile) as exc:
            skipped.append(Skipped(rel, _without_prefix(str(exc), rel)))
            continue
        except InputError as exc:
            raise InputError(
                f"{exc}; a damaged torch file may have held optimizer state, so {root} is not judged"
            ) from None
        if inventory.optimizers:
            files.append(inventory)
        else:
            skipped.append(Skipped(rel, "holds no optimizer state"))
    if not any(file.optimizers for file in files):
        raise InputError(f"{root}: no optimizer state found in any file ({len(skipped)} file(s) skipped)")
    fmt: Literal["torch", "dcp"] = "dcp" if dcp_roots and all(file.format == "dcp" for file in files) else "torch"
    return CheckpointInventory(str(root), fmt, True, tuple(files), tuple(skipped), tuple(weights))


def read_model_weights(path: Path) -> tuple[WeightMap, ...]:
    """Parameter shapes from ``--model``: a safetensors file, a torch file, or a DCP directory."""
    if not path.exists():
        raise InputError(f"{path}: no such file or directory (--model)")
    if path.is_dir():
        if not dcp.is_dcp_directory(path):
            raise InputError(f"{path}: --model takes a safetensors file, a torch file or a DCP directory")
        return dcp.read_dcp(path, str(path)).weights
    if path.suffix == ".safetensors":
        return (read_weights(path, str(path)),)
    inventory = read_inventory(path, str(path), str(path))
    if not inventory.weights:
        raise InputError(f"{path}: holds no mapping of parameter names to tensors (--model)")
    return inventory.weights
