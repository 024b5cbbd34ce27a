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
Links that lead to the same directory again multiply what is walked (24 levels of two links each reach 2**24
paths without a loop), so a dereferencing walk stops past ``MAX_REACHED_PATHS`` paths or ``MAX_REACHED_BYTES``.
"""

from __future__ import annotations

import difflib
import itertools
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from optim_repair.errors import InputError, os_error_reason
from optim_repair.formats.dcp import SHARD_SUFFIX, is_dcp_directory, metadata_names
from optim_repair.formats.registry import Role, is_dcp_metadata, role_of
from optim_repair.formats.safetensors import SAFETENSORS_SUFFIX
from optim_repair.formats.torchfile import TORCH_SUFFIXES
from optim_repair.records.steps import save_under_way, step_number
from optim_repair.storage.disk import kind_of


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


def _link_target(path: str | Path) -> tuple[os.stat_result | None, str]:
    """What the link ``path`` reaches: its status (None when it reaches nothing) and that, in words, when it is
    no regular file or directory."""
    try:
        status = os.stat(path)
    except OSError:
        return None, "a link to nothing"
    if stat.S_ISREG(status.st_mode) or stat.S_ISDIR(status.st_mode):
        return status, ""
    return status, f"a link to {kind_of(status.st_mode)}"


def _points_outside(path: Path, real_root: Path) -> bool:
    """Whether the link ``path`` is absolute or reaches something outside the checkpoint ``real_root``."""
    if os.path.isabs(os.readlink(path)):
        return True
    real = Path(os.path.realpath(path))
    return real != real_root and real_root not in real.parents


def _linked_entry(path: Path, rel: str, role: Role, dcp: str | None, real_root: Path) -> Entry:
    """A link kept as a link: a file ``role`` when it reaches a regular file, ``directory`` for a directory."""
    target, kind = _link_target(path)
    outside = _points_outside(path, real_root)
    if target is not None and stat.S_ISDIR(target.st_mode):
        return Entry(rel, "directory", True, dcp, "", outside)
    return Entry(rel, role, True, dcp, kind, outside)


def _followed_directory(path: Path, real_directory: str) -> str:
    """The real path of the linked directory ``path``, found in the directory whose real path is
    ``real_directory``; refused when following it would loop (it is that directory or holds it).

    Resolved from ``real_directory``, which holds no link, so that only this link is resolved again: resolving
    ``path`` itself would resolve every link above it, each time, and a deep walk would slow with its depth."""
    real = os.path.realpath(os.path.join(real_directory, path.name))
    if real_directory == real or real_directory.startswith(real.rstrip("/") + "/"):
        raise InputError(
            "is a link to a directory that holds it; {argument} cannot copy a loop", path=path, argument="dereference"
        )
    return real


MAX_DEPTH = 64
"""How deep a checkpoint's directories may nest: real ones are a few levels deep; deeper is refused, one line."""

MAX_REACHED_PATHS = 100_000
"""How many paths (files, directories, links) a dereferencing walk may reach. The largest real checkpoints (a DCP
checkpoint of a few thousand ranks, each writing a few shards; a Hugging Face cache snapshot) hold tens of
thousands; but links that lead to the same directory again multiply what is walked without any loop: 24 levels of
two links each reach 2**24 paths, which would take hours to list and ``fix`` would copy every one. The walk reaches
this many in one or two seconds."""

MAX_REACHED_BYTES = 2**48
"""How many bytes of regular files (256 TiB) a dereferencing walk may reach, each file counted once per path that
reaches it, as that is what a copy holds. The largest real checkpoints (a trillion parameters, with fp32 master
weights and two Adam moments) hold about 20 TB, and no file system under a training job holds ten times that free;
a few links to a large (even sparse) file would pass it in a few paths, long before the path bound."""


class _Reach:
    """What a dereferencing walk has reached so far: refused, naming the checkpoint ``source``, as soon as it
    passes ``MAX_REACHED_PATHS`` or ``MAX_REACHED_BYTES``, so that the walk stops there and lists nothing more."""

    def __init__(self, source: Path) -> None:
        self.source = source
        self.paths = 0
        self.bytes = 0

    def reached(self, size: int = 0) -> None:
        """Count one more path, a regular file of ``size`` bytes, or anything else (0)."""
        self.paths += 1
        self.bytes += size
        if self.paths > MAX_REACHED_PATHS:
            self._refuse(f"{MAX_REACHED_PATHS:,} paths", "directories multiply what is walked")
        if self.bytes > MAX_REACHED_BYTES:
            self._refuse(f"{MAX_REACHED_BYTES // 2**40:,} TiB of files", "files or directories multiply what is copied")

    def _refuse(self, bound: str, multiplied: str) -> None:
        raise InputError(
            f"following links reaches more than {bound} (links that lead to the same {multiplied}); "
            "pass it without {argument}",
            path=self.source,
            argument="dereference",
        )


def _listing(directory: str, root: Path, rel: str) -> tuple[list[str], list[str]]:
    """The names of the files (and links to anything but a directory) and of the directories in ``directory``
    (``root / rel`` in messages), each sorted; an entry that cannot be listed or looked at is an error, never
    skipped."""
    files: list[str] = []
    directories: list[str] = []
    try:
        with os.scandir(directory) as found:
            for item in found:
                (directories if item.is_dir() else files).append(item.name)
    except FileNotFoundError as exc:
        raise InputError("vanished while being read", path=_short(root / rel)) from exc
    except OSError as exc:
        raise InputError(f"cannot read ({os_error_reason(exc)})", path=_short(root / rel)) from exc
    return sorted(files), sorted(directories)


def _walk(root: Path, *, reach: _Reach | None = None) -> Iterator[Entry]:
    """Every entry under ``root``, top-down, each directory's files before its subdirectories, depth first.

    With ``reach``, every link is followed (``dereference``), each entry is counted there as it is found, and each
    directory is read at its real path: through the links that lead to it, the kernel would resolve every one of
    them again for each name in it. Paths are strings here (``pathlib`` would take most of the time)."""
    inside: dict[str, str] = {}  # a directory inside a DCP checkpoint -> that checkpoint's rel
    real_root = Path(os.path.realpath(root))
    followed: dict[tuple[str, str], str] = {}  # (real directory, name of a linked directory in it) -> its real path
    pending = [("", str(real_root) if reach is not None else str(root))]  # each directory's rel, and where it is read
    while pending:
        rel, directory = pending.pop()
        if rel.count("/") >= MAX_DEPTH:
            raise InputError(f"nests directories more than {MAX_DEPTH} deep", path=_short(root / rel))
        files, subdirectories = _listing(directory, root, rel)
        dcp = inside.get(rel)
        if dcp is None and metadata_names(files) and is_dcp_directory(Path(directory)):
            yield Entry(rel, "dcp")
            dcp = rel
        for name in files:
            yield _file_entry(os.path.join(directory, name), _below(rel, name), root, dcp, real_root, reach)
        walked = []
        for name in subdirectories:
            path, below = os.path.join(directory, name), _below(rel, name)
            if dcp is not None:
                inside[below] = dcp
            if os.path.islink(path):
                if reach is None:
                    yield _linked_entry(Path(path), below, "directory", dcp, real_root)
                    continue
                path = followed.get((directory, name)) or _followed_directory(root / below, directory)
                followed[directory, name] = path
            if reach is not None:
                reach.reached()
            yield Entry(below, "directory", False, dcp)
            walked.append((below, path))
        pending.extend(reversed(walked))


def _below(rel: str, name: str) -> str:
    """The ``rel`` of ``name`` in the directory of ``rel``."""
    return f"{rel}/{name}" if rel else name


def _file_entry(path: str, rel: str, root: Path, dcp: str | None, real_root: Path, reach: _Reach | None) -> Entry:
    """The entry of the file at ``path`` (or of a link to anything but a directory), ``root / rel`` in messages;
    with ``reach``, the link followed and what it reaches counted."""
    try:
        status = os.lstat(path)
    except FileNotFoundError as exc:
        raise InputError("vanished while being read", path=_short(root / rel)) from exc
    except OSError as exc:
        raise InputError(f"cannot read ({os_error_reason(exc)})", path=_short(root / rel)) from exc
    role: Role = "file" if dcp is not None else role_of(rel.rpartition("/")[2])
    if reach is not None:
        if stat.S_ISLNK(status.st_mode):
            target, kind = _link_target(path)
            if kind or target is None:
                reach.reached()
                return Entry(rel, "special", False, dcp, kind)
            status = target
        reach.reached(status.st_size if stat.S_ISREG(status.st_mode) else 0)
    mode = status.st_mode
    if stat.S_ISLNK(mode):
        return _linked_entry(Path(path), rel, role, dcp, real_root)
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
        if is_dcp_metadata(path.name) or path.suffix == SHARD_SUFFIX:
            raise InputError(f"part of a DCP checkpoint; pass its directory, {path.parent}", path=path)
        if path.suffix == SAFETENSORS_SUFFIX:
            raise InputError(model_only(target), path=path)
        neighbours = tuple(sorted(target.parent.glob(f"*{SAFETENSORS_SUFFIX}")))
        return Discovery(path, target, False, (Entry("", "torch"),), neighbours, dereference, (signature(target),))
    if not stat.S_ISDIR(mode):
        raise InputError(f"is {kind_of(mode)}, not a file or directory", path=path)
    try:
        entries = tuple(_walk(target, reach=_Reach(path) if dereference else None))
    except OSError as exc:  # a name past PATH_MAX, an entry that turned unreadable mid-walk
        raise InputError(f"cannot read ({os_error_reason(exc)})", path=_short(Path(exc.filename or path))) from exc
    signatures = tuple(signature(target / entry.rel if entry.rel else target) for entry in entries)
    return Discovery(path, target, True, entries, (), dereference, signatures)


def _complete(step: Path) -> bool:
    """Whether a step of a run was written to the end: a non-empty file, or a directory holding some file in
    which no DCP checkpoint lacks its ``.metadata`` (torch's writer commits it last) and no library's save is still
    under way (``save_under_way``: the HF Trainer's ``trainer_state.json``, written last)."""
    if not step.is_dir():
        return step.is_file() and step.stat().st_size > 0
    files = False

    def fail(exc: OSError) -> None:
        raise exc

    for directory, _, names in os.walk(step, onerror=fail):
        if directory == str(step) and save_under_way(names):
            return False
        files = files or bool(names)
        if any(name.endswith(SHARD_SUFFIX) for name in names) and not any(is_dcp_metadata(name) for name in names):
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
            "holds no complete checkpoint step (checkpoint-N, step-N, global_stepN, iter_N or epoch=E-step=S.ckpt)",
            path=run,
        )
    return run / steps[-1][1]
