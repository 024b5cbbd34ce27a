"""What a checkpoint argument holds: one walk of it, giving each file and directory its role.

Reading, writing and verifying all follow this list, so a format, a suffix or a link policy is
decided here once: torch files are found by suffix, safetensors files give parameter shapes, a
directory holding ``.metadata`` is a DCP checkpoint whose files are its members (read through its
metadata, never as torch files).

Symbolic links (the Hugging Face cache's ``snapshots/<rev>/`` links into ``blobs/``, DVC, a ``latest``
link) are copied as links, as ``cp -R`` does. A link to a regular file outside the checkpoint is read
through, and is written as a regular file when the repair changes it; one to a file inside is the same
file as that entry and is not read twice; a linked directory is not walked. With ``dereference`` (``cp
-L``) every link is followed: its file or directory is read and copied as if it were there, a link to
anything else (a FIFO, a device, nothing) is ``special``, and a link to a directory holding it is refused.
"""

from __future__ import annotations

import difflib
import itertools
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from optim_repair.errors import InputError, os_error_reason
from optim_repair.formats.dcp import METADATA_FILE, SHARD_SUFFIX, is_dcp_directory
from optim_repair.formats.inputs import kind_of
from optim_repair.formats.safetensors import SAFETENSORS_SUFFIX
from optim_repair.formats.torchfile import TORCH_SUFFIXES
from optim_repair.records.steps import step_number

Role = Literal["torch", "safetensors", "dcp", "file", "directory", "special"]
"""``torch``: may hold optimizers; ``safetensors``: model weights; ``dcp``: a DCP checkpoint directory;
``file``: anything else, copied as it is (every member of a DCP checkpoint); ``directory``: a directory
to recreate; ``special``: a FIFO, socket or device, which is never opened."""


@dataclass(frozen=True)
class Entry:
    """One thing found under the argument."""

    rel: str
    """Its path relative to the argument, with ``/``; ``""`` is the argument itself."""
    role: Role
    link: bool = False
    """Whether it is a symbolic link kept as a link: copied as one unless the repair rewrites its file."""
    dcp: str | None = None
    """For a member of a DCP checkpoint: that checkpoint's ``rel``."""
    kind: str = ""
    """For a ``special`` entry: what it is (``a FIFO``); for a link: what it points to when that is no regular
    file or directory (``a link to nothing``)."""
    outside: bool = False
    """For a link: whether it points outside the checkpoint (an absolute link, or a relative one leaving it),
    so that a copy elsewhere may not reach what it reaches. A link pointing inside is not read itself."""

    @property
    def read_through(self) -> bool:
        """Whether reading opens it: not for a link that reaches no regular file, or one that reaches a file of
        the checkpoint, which is read where it is."""
        return not self.link or (not self.kind and self.outside)

    def member_name(self) -> str:
        """A DCP member's path relative to its checkpoint directory."""
        return self.rel[len(self.dcp) + 1 :] if self.dcp else self.rel


@dataclass(frozen=True)
class Discovery:
    """Everything under one checkpoint argument, in a stable order, with its role."""

    root: Path
    """The argument as given, for messages."""
    target: Path
    """The argument with a link resolved: the one link optim-repair follows is the argument itself."""
    is_directory: bool
    entries: tuple[Entry, ...]
    neighbours: tuple[Path, ...] = ()
    """For a file argument: the safetensors files beside it (HF's ``model.safetensors``), for shapes."""
    dereference: bool = False
    """Whether every link under the argument was followed (``cp -L``) instead of kept."""
    signatures: tuple[Signature, ...] = ()
    """What each entry was when it was found (``signature``), in the order of ``entries``."""

    def path(self, entry: Entry) -> Path:
        return self.target / entry.rel if entry.rel else self.target

    def with_role(self, role: Role) -> Iterator[Entry]:
        return (entry for entry in self.entries if entry.role == role)

    def members(self, dcp: str) -> tuple[Entry, ...]:
        """Every file and directory of the DCP checkpoint ``dcp``, in walk order."""
        return tuple(entry for entry in self.entries if entry.dcp == dcp)

    def check_unchanged(self) -> None:
        """Raise ``InputError`` naming the first entry that is not what it was when it was found: written to,
        replaced, grown or gone (a run still saving the checkpoint), so that no copy pairs two versions of it."""
        for entry, before in zip(self.entries, self.signatures, strict=True):
            if signature(self.path(entry)) != before:
                raise InputError("changed while being read (is a run still saving it?)", path=self.root / entry.rel)

    def links_outside(self) -> tuple[str, ...]:
        """The links kept as links that point outside the checkpoint."""
        return tuple(entry.rel for entry in self.entries if entry.link and entry.outside)

    def linked_directories(self) -> tuple[str, ...]:
        """The links to directories, which are kept and not walked unless ``dereference``."""
        return tuple(entry.rel for entry in self.entries if entry.link and entry.role == "directory")


Signature = tuple[tuple[int, int, int, int] | None, tuple[int, int, int, int] | None]
"""(device, inode, size, modification time in ns) of an entry itself and of what it reaches (a link's target)."""


def _status(path: Path, *, follow: bool) -> tuple[int, int, int, int] | None:
    try:
        found = os.stat(path, follow_symlinks=follow)
    except OSError:
        return None
    return found.st_dev, found.st_ino, found.st_size, found.st_mtime_ns


def signature(path: Path) -> Signature:
    """What ``path`` is now, to tell later whether it changed: the same inode, size and modification time."""
    return _status(path, follow=False), _status(path, follow=True)


def relative(path: Path, root: Path) -> str:
    return "" if path == root else path.relative_to(root).as_posix()


def _file_role(name: str) -> Role:
    suffix = Path(name).suffix
    if suffix == SAFETENSORS_SUFFIX:
        return "safetensors"
    return "torch" if suffix in TORCH_SUFFIXES else "file"


def _link_target(path: Path) -> tuple[int | None, str]:
    """What the link ``path`` reaches: its mode (None when it reaches nothing) and that, in words, when it is
    no regular file or directory."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None, "a link to nothing"
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return mode, ""
    return mode, f"a link to {kind_of(mode)}"


def _points_outside(path: Path, real_root: Path) -> bool:
    """Whether the link ``path`` is absolute or reaches something outside the checkpoint ``real_root``."""
    if os.path.isabs(os.readlink(path)):
        return True
    real = Path(os.path.realpath(path))
    return real != real_root and real_root not in real.parents


def _linked_entry(path: Path, rel: str, role: Role, dcp: str | None, real_root: Path) -> Entry:
    """A link kept as a link: a file ``role`` when it reaches a regular file, ``directory`` for a directory."""
    mode, kind = _link_target(path)
    outside = _points_outside(path, real_root)
    if mode is not None and stat.S_ISDIR(mode):
        return Entry(rel, "directory", True, dcp, "", outside)
    return Entry(rel, role, True, dcp, kind, outside)


def _followed_directory(path: Path, directory: Path) -> None:
    """Refuse to follow the linked directory ``path`` (found in ``directory``) into a loop."""
    real, here = Path(os.path.realpath(path)), Path(os.path.realpath(directory))
    if real == here or real in here.parents:
        raise InputError("is a link to a directory that holds it; --dereference cannot copy a loop", path=path)


MAX_DEPTH = 64
"""How deep a checkpoint's directories may nest: real ones are a few levels deep; deeper is refused, one line."""


def _listing(directory: Path) -> tuple[list[str], list[str]]:
    """The names of the files (and links to anything but a directory) and of the directories in ``directory``,
    each sorted; an entry that cannot be listed or looked at is an error, never skipped."""
    files: list[str] = []
    directories: list[str] = []
    try:
        with os.scandir(directory) as found:
            for item in found:
                (directories if item.is_dir() else files).append(item.name)
    except FileNotFoundError as exc:
        raise InputError("vanished while being read", path=_short(directory)) from exc
    except OSError as exc:
        raise InputError(f"cannot read ({os_error_reason(exc)})", path=_short(directory)) from exc
    return sorted(files), sorted(directories)


def _walk(root: Path, *, dereference: bool) -> Iterator[Entry]:
    """Every entry under ``root``, top-down, each directory's files before its subdirectories, depth first."""
    inside: dict[str, str] = {}  # a directory inside a DCP checkpoint -> that checkpoint's rel
    real_root = Path(os.path.realpath(root))
    pending = [root]
    while pending:
        directory = pending.pop()
        rel = relative(directory, root)
        if rel.count("/") >= MAX_DEPTH:
            raise InputError(f"nests directories more than {MAX_DEPTH} deep", path=_short(root / rel))
        files, subdirectories = _listing(directory)
        dcp = inside.get(rel)
        if dcp is None and METADATA_FILE in files and is_dcp_directory(directory):
            yield Entry(rel, "dcp")
            dcp = rel
        for name in files:
            yield _file_entry(directory / name, relative(directory / name, root), dcp, real_root, dereference)
        walked = []
        for name in subdirectories:
            path = directory / name
            if dcp is not None:
                inside[relative(path, root)] = dcp
            if not path.is_symlink():
                yield Entry(relative(path, root), "directory", False, dcp)
            elif dereference:
                _followed_directory(path, directory)
                yield Entry(relative(path, root), "directory", False, dcp)
            else:
                yield _linked_entry(path, relative(path, root), "directory", dcp, real_root)
                continue
            walked.append(path)
        pending.extend(reversed(walked))


def _file_entry(path: Path, rel: str, dcp: str | None, real_root: Path, dereference: bool) -> Entry:
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError as exc:
        raise InputError("vanished while being read", path=_short(path)) from exc
    except OSError as exc:
        raise InputError(f"cannot read ({os_error_reason(exc)})", path=_short(path)) from exc
    role: Role = "file" if dcp is not None else _file_role(path.name)
    if stat.S_ISLNK(mode) and dereference:
        target, kind = _link_target(path)
        if kind:
            return Entry(rel, "special", False, dcp, kind)
        mode = target or mode
    if stat.S_ISLNK(mode):
        return _linked_entry(path, rel, role, dcp, real_root)
    if stat.S_ISREG(mode):
        return Entry(rel, role, False, dcp)
    return Entry(rel, "special", False, dcp, kind_of(mode))


def _short(path: Path, limit: int = 160) -> str:
    """``path`` for a message: a path of thousands of characters shown by its two ends."""
    text = str(path)
    return text if len(text) <= limit else f"{text[: limit // 2]}…{text[-limit // 2 :]}"


def model_only(path: Path, beside: list[str] | None = None) -> str:
    """Why the model file ``path`` is no checkpoint to inspect, and where its optimizer state usually is (among
    the files ``beside`` it: by default, those in its directory)."""
    if beside is None:
        beside = sorted(p.name for p in path.parent.glob("optimizer*") if p.suffix in TORCH_SUFFIXES and p.is_file())
    if beside:
        where = f"is in {', '.join(beside)} beside it: pass that, or the directory {path.parent}"
    else:
        where = "is usually in optimizer.pt beside it (HF Trainer, Accelerate: optimizer.bin)"
    return f"model weights, not optimizer state; the optimizer {where}"


def _did_you_mean(path: Path) -> str:
    """A close sibling of a path that does not exist: ``checkpoint-100`` for ``checkpont-100``."""
    try:
        with os.scandir(path.parent) as entries:
            names = [entry.name for entry in itertools.islice(entries, 10000)]
    except OSError:
        return ""
    close = difflib.get_close_matches(path.name, names, n=1, cutoff=0.75)
    return f"; did you mean {path.parent / close[0]}?" if close else ""


def discover(path: Path, *, dereference: bool = False) -> Discovery:
    """The role of everything under ``path``: a torch file, a checkpoint directory or a DCP directory; with
    ``dereference``, every link under it followed (``cp -L``)."""
    try:
        target = Path(os.path.realpath(path)) if path.is_symlink() else path
        mode = os.stat(target).st_mode
    except FileNotFoundError as exc:
        raise InputError(f"no such file or directory{_did_you_mean(path)}", path=path) from exc
    except OSError as exc:
        raise InputError(f"cannot read ({os_error_reason(exc)})", path=path) from exc
    if stat.S_ISREG(mode):
        if path.name == METADATA_FILE or path.suffix == SHARD_SUFFIX:
            raise InputError(f"part of a DCP checkpoint; pass its directory, {path.parent}", path=path)
        if path.suffix == SAFETENSORS_SUFFIX:
            raise InputError(model_only(target), path=path)
        neighbours = tuple(sorted(target.parent.glob(f"*{SAFETENSORS_SUFFIX}")))
        return Discovery(path, target, False, (Entry("", "torch"),), neighbours, dereference, (signature(target),))
    if not stat.S_ISDIR(mode):
        raise InputError(f"is {kind_of(mode)}, not a file or directory", path=path)
    try:
        entries = tuple(_walk(target, dereference=dereference))
    except OSError as exc:  # a name past PATH_MAX, an entry that turned unreadable mid-walk
        raise InputError(f"cannot read ({os_error_reason(exc)})", path=_short(Path(exc.filename or path))) from exc
    signatures = tuple(signature(target / entry.rel if entry.rel else target) for entry in entries)
    return Discovery(path, target, True, entries, (), dereference, signatures)


def _complete(step: Path) -> bool:
    """Whether a step of a run was written to the end: a non-empty file, or a directory holding some file in
    which no DCP checkpoint lacks its ``.metadata`` (torch's writer commits it last)."""
    if not step.is_dir():
        return step.is_file() and step.stat().st_size > 0
    files = False

    def fail(exc: OSError) -> None:
        raise exc

    for _, _, names in os.walk(step, onerror=fail):
        files = files or bool(names)
        if any(name.endswith(SHARD_SUFFIX) for name in names) and METADATA_FILE not in names:
            return False
    return files


def latest_step(run: Path) -> Path:
    """The newest complete step of the run directory ``run`` (``checkpoint-N``, ``step-N``, ``global_stepN``,
    ``epoch=E-step=S.ckpt``); a step still being written (a DCP checkpoint without ``.metadata``, an empty
    one) is passed over. Raises ``InputError`` when there is none."""
    try:
        steps = sorted(
            (number, entry.name)
            for entry in os.scandir(run)
            if (number := step_number(entry.name)) is not None and _complete(run / entry.name)
        )
    except FileNotFoundError as exc:
        raise InputError(f"no such file or directory{_did_you_mean(run)}", path=run) from exc
    except OSError as exc:
        raise InputError(f"cannot read ({os_error_reason(exc)})", path=getattr(exc, "filename", None) or run) from exc
    if not steps:
        raise InputError(
            "holds no complete checkpoint step (checkpoint-N, step-N, global_stepN or epoch=E-step=S.ckpt)", path=run
        )
    return run / steps[-1][1]
