"""What a checkpoint argument holds: one walk of it, giving each file and directory its role.

Reading, writing and verifying all follow this list, so a format, a suffix or a link policy is
decided here once: torch files are found by suffix, safetensors files give parameter shapes, a
directory holding ``.metadata`` is a DCP checkpoint whose files are its members (read through its
metadata, never as torch files), and a symbolic link is never followed: it is copied as a link.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from optim_repair.errors import InputError
from optim_repair.formats.dcp import METADATA_FILE, SHARD_SUFFIX, is_dcp_directory
from optim_repair.formats.safetensors import SAFETENSORS_SUFFIX
from optim_repair.formats.torchfile import TORCH_SUFFIXES

Role = Literal["torch", "safetensors", "dcp", "file", "directory"]
"""``torch``: may hold optimizers; ``safetensors``: model weights; ``dcp``: a DCP checkpoint directory;
``file``: anything else, copied as it is (every member of a DCP checkpoint); ``directory``: a directory
to recreate."""


@dataclass(frozen=True)
class Entry:
    """One thing found under the argument."""

    rel: str
    """Its path relative to the argument, with ``/``; ``""`` is the argument itself."""
    role: Role
    link: bool = False
    """Whether it is a symbolic link: copied as a link unless it is rewritten with additions."""
    dcp: str | None = None
    """For a member of a DCP checkpoint: that checkpoint's ``rel``."""

    def member_name(self) -> str:
        """A DCP member's path relative to its checkpoint directory."""
        return self.rel[len(self.dcp) + 1 :] if self.dcp else self.rel


@dataclass(frozen=True)
class Discovery:
    """Everything under one checkpoint argument, in a stable order, with its role."""

    root: Path
    is_directory: bool
    entries: tuple[Entry, ...]
    neighbours: tuple[Path, ...] = ()
    """For a file argument: the safetensors files beside it (HF's ``model.safetensors``), for shapes."""

    def path(self, entry: Entry) -> Path:
        return self.root / entry.rel if entry.rel else self.root

    def with_role(self, role: Role) -> Iterator[Entry]:
        return (entry for entry in self.entries if entry.role == role)

    def members(self, dcp: str) -> tuple[Entry, ...]:
        """Every file and directory of the DCP checkpoint ``dcp``, in walk order."""
        return tuple(entry for entry in self.entries if entry.dcp == dcp)


def relative(path: Path, root: Path) -> str:
    return "" if path == root else path.relative_to(root).as_posix()


def _file_role(name: str) -> Role:
    suffix = Path(name).suffix
    if suffix == SAFETENSORS_SUFFIX:
        return "safetensors"
    return "torch" if suffix in TORCH_SUFFIXES else "file"


def _walk(root: Path) -> Iterator[Entry]:
    inside: dict[str, str] = {}  # a directory inside a DCP checkpoint -> that checkpoint's rel
    for current, subdirectories, files in os.walk(root):  # never into a linked directory
        directory = Path(current)
        rel = relative(directory, root)
        subdirectories.sort()
        dcp = inside.get(rel)
        if dcp is None and METADATA_FILE in files and is_dcp_directory(directory):
            yield Entry(rel, "dcp")
            dcp = rel
        for name in sorted(files):
            path = directory / name
            role: Role = "file" if dcp is not None else _file_role(name)
            yield Entry(relative(path, root), role, path.is_symlink(), dcp)
        for name in subdirectories:
            path = directory / name
            if dcp is not None:
                inside[relative(path, root)] = dcp
            yield Entry(relative(path, root), "directory", path.is_symlink(), dcp)


def discover(path: Path) -> Discovery:
    """The role of everything under ``path``: a torch file, a checkpoint directory or a DCP directory."""
    if not path.exists():
        raise InputError("no such file or directory", path=str(path))
    if path.is_file():
        if path.name == METADATA_FILE or path.suffix == SHARD_SUFFIX:
            raise InputError(f"part of a DCP checkpoint; pass its directory, {path.parent}", path=str(path))
        neighbours = tuple(sorted(path.parent.glob(f"*{SAFETENSORS_SUFFIX}")))
        return Discovery(path, False, (Entry("", "torch"),), neighbours)
    if not path.is_dir():
        raise InputError("not a file or directory", path=str(path))
    return Discovery(path, True, tuple(_walk(path)))
