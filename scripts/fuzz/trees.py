"""A case's input as a tree of files, links, FIFOs and directories: made, read back and snapshotted."""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Link:
    """A symbolic link to ``target``."""

    target: str


@dataclass(frozen=True)
class Fifo:
    """A named pipe: opening it for reading blocks until a writer comes."""


@dataclass(frozen=True)
class Dir:
    """A directory (its contents are the entries below it)."""


Node = bytes | Link | Fifo | Dir
Tree = dict[str, Node]
"""A case's input directory: path relative to it (``/`` separators) -> what lies there."""


@dataclass(frozen=True)
class Seed:
    """One real checkpoint: ``arg`` (a file or directory under the tree's root) is what the tool is given."""

    name: str
    kind: str
    """``zip``, ``legacy``, ``dcp`` or ``directory``."""
    arg: str
    tree: Mapping[str, Node]


def materialize(tree: Mapping[str, Node], root: Path) -> None:
    """Create ``tree`` under the (new or empty) directory ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    for rel in sorted(tree):
        node, path = tree[rel], root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(node, bytes):
            path.write_bytes(node)
        elif isinstance(node, Dir):
            path.mkdir(exist_ok=True)
        elif isinstance(node, Link):
            os.symlink(node.target, path)
        else:
            os.mkfifo(path)


def read_tree(root: Path) -> Tree:
    """The tree under ``root``, links and FIFOs as such."""
    tree: Tree = {}
    for current, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            path = Path(current, name)
            rel = path.relative_to(root).as_posix()
            mode = path.lstat().st_mode
            if stat.S_ISLNK(mode):
                tree[rel] = Link(os.readlink(path))
            elif stat.S_ISDIR(mode):
                tree[rel] = Dir()
            elif stat.S_ISFIFO(mode):
                tree[rel] = Fifo()
            else:
                tree[rel] = path.read_bytes()
    return tree


Snapshot = dict[str, tuple[Any, ...]]


def snapshot(root: Path) -> Snapshot:
    """Every entry under ``root`` (and ``root``) with its type, mode, size, mtime and content hash; no link followed."""
    found: Snapshot = {}
    for current, dirs, files in os.walk(root):
        for name in ["", *dirs, *files] if current == str(root) else [*dirs, *files]:
            path = os.path.join(current, name) if name else current
            st = os.lstat(path)
            rel = os.path.relpath(path, root)
            if stat.S_ISREG(st.st_mode):
                with open(path, "rb") as stream:
                    digest = hashlib.blake2b(stream.read(), digest_size=16).hexdigest()
                found[rel] = ("file", st.st_mode, st.st_size, st.st_mtime_ns, digest)
            elif stat.S_ISLNK(st.st_mode):
                found[rel] = ("link", os.readlink(path))
            elif stat.S_ISDIR(st.st_mode):
                found[rel] = ("dir", st.st_mode, st.st_mtime_ns)
            else:
                found[rel] = ("special", st.st_mode, st.st_mtime_ns)
    return found


def differences(before: Snapshot, after: Snapshot) -> list[str]:
    changed = [f"{rel}: {before[rel]} -> {after.get(rel, 'gone')}" for rel in before if before[rel] != after.get(rel)]
    return changed + [f"{rel}: new {after[rel]}" for rel in after if rel not in before]


def under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")
