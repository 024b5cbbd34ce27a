"""The temporary sibling of ``--out``: made, locked while its run lives, moved into place, or removed.

A copy is written into ``.NAME.optim-repair-tmp-XXXXXXXX`` beside ``NAME`` and renamed into place only
once verified, so that ``NAME`` is never incomplete. The run holds an ``flock`` on its temporary for
its whole life; a later run that finds a temporary nobody holds (its run was killed) removes it and
says so. Without ``force`` the rename refuses to replace anything (``renameat2(RENAME_NOREPLACE)``),
so that of two runs racing to one ``--out`` the later fails instead of silently replacing the other.

Within ``recorded_placements`` (the command line's whole run), each copy moved into place is recorded, so
that a run that fails after all (its result could not be printed, a signal came) can say that its copy is
finished and kept: a copy once verified and in place is never removed again.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from optim_repair.errors import OutputError, Remedy, os_error_reason
from optim_repair.signals import held
from optim_repair.storage.disk import kind_of

STALE_AFTER_SECONDS = 10
"""A temporary nobody holds is left alone this long after its last change (its run may be starting)."""
_RENAME_NOREPLACE = 1
_AT_FDCWD = -100


def remove(path: Path) -> None:
    """Remove a file, link or directory tree, whatever is there; never follows a link."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _prefix(out: Path) -> str:
    return f".{out.name}.optim-repair-tmp-"


def _locked(path: Path) -> int | None:
    """A descriptor holding an exclusive lock on ``path``, or None when another process holds one."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0))
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        return None
    return descriptor


def remove_stale(out: Path, notice: Callable[[str], None]) -> None:
    """Remove the temporaries beside ``out`` that runs killed before they could clean up left behind."""
    parent = Path(os.path.abspath(out)).parent
    for path in sorted(parent.glob(f"{_prefix(out)}*")):
        try:
            status = path.lstat()
            if not (stat.S_ISREG(status.st_mode) or stat.S_ISDIR(status.st_mode)):
                continue  # only what a run creates: a FIFO planted under the name would block the open
            if time.time() - status.st_mtime < STALE_AFTER_SECONDS:
                continue
            descriptor = _locked(path)
        except OSError:
            continue
        if descriptor is None:
            continue  # a live run's
        try:
            remove(path)
            notice(f"removed {path}, a temporary copy left by a run that was killed")
        finally:
            os.close(descriptor)


@contextlib.contextmanager
def temporary_sibling(out: Path, *, directory: bool) -> Iterator[Path]:
    """A new, locked temporary path beside ``out``, removed on the way out unless moved into place.

    Created with mode 0o666 (0o777 for a directory), so that the process umask applies as it would
    to any new file (``tempfile.mkstemp`` would give 0o600).
    """
    parent = Path(os.path.abspath(out)).parent  # beside a link named out, not beside its target
    tmp: Path | None = None
    lock: int | None = None
    try:
        # The signals that end a run are held while the temporary is created and recorded, and while it is
        # removed: a handler that raised between the two, or in the middle of the removal, would leave it
        # behind (seen under load: SIGTERM during the lock).
        with held():
            tmp, lock = _created(parent, out, directory=directory)
        yield tmp
    finally:
        with held():
            if lock is not None:
                os.close(lock)
            if tmp is not None:
                remove(tmp)


def _created(parent: Path, out: Path, *, directory: bool) -> tuple[Path, int | None]:
    """A new temporary file or directory beside ``out``, under a name no other run uses, and its lock."""
    for _ in range(100):
        tmp = parent / f"{_prefix(out)}{os.urandom(4).hex()}"
        try:
            if directory:
                tmp.mkdir(0o777)
            else:
                os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except FileExistsError:
            continue
        except OSError as exc:
            raise OutputError(f"cannot write ({os_error_reason(exc)})", path=parent) from exc
        try:
            return tmp, _locked(tmp)
        except BaseException:
            remove(tmp)
            raise
    raise OutputError("cannot find an unused temporary name", path=parent)


def _rename_no_replace(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` to ``out``, atomically failing with FileExistsError if ``out`` exists."""
    import ctypes  # only here: imported at the top, it would slow every command's start

    libc = ctypes.CDLL(None, use_errno=True)  # the C library already loaded; find_library would run ldconfig
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is not None:
        if renameat2(_AT_FDCWD, os.fsencode(tmp), _AT_FDCWD, os.fsencode(out), _RENAME_NOREPLACE) == 0:
            return
        code = ctypes.get_errno()
        if code not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
            raise OSError(code, os.strerror(code), str(out))
    if tmp.is_dir():  # no renameat2 here: claim the name with mkdir, then replace the empty placeholder
        os.mkdir(out)
        os.replace(tmp, out)
    else:
        os.link(tmp, out)
        os.unlink(tmp)


_recording: list[list[Path]] = []
"""The copies moved into place within each open ``recorded_placements``, innermost last."""


@contextlib.contextmanager
def recorded_placements() -> Iterator[list[Path]]:
    """Within the block, each copy moved into place is recorded in the list it yields (by the innermost such
    block only), and stays where it is whatever the block raises afterwards.

    The command line runs a whole command in one, its output included, so that a run that cannot print its
    result, or that a signal stops after the rename, can say that its copy was written, verified and kept."""
    placed: list[Path] = []
    _recording.append(placed)
    try:
        yield placed
    finally:
        _recording.remove(placed)


def move_into_place(tmp: Path, out: Path, *, force: bool, sync: bool = True) -> None:
    """Make ``tmp`` be ``out``: without ``force`` only if nothing is there; with it, replacing what is.
    With ``sync``, the directory holding ``out`` is synced after, so that the rename survives a crash."""
    with held():  # renamed and recorded together, or neither: a failure after the rename can say it is kept
        _rename(tmp, out, force=force)
        if _recording:
            _recording[-1].append(out)
    if sync:
        descriptor = os.open(Path(os.path.abspath(out)).parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def refuse_to_replace(out: Path) -> None:
    """Raise ``OutputError`` unless what is at ``out`` is what ``--force`` may replace: a regular file, a
    directory or a link (never a device, a FIFO or a socket: ``--out /dev/null --force`` as root)."""
    try:
        mode = os.lstat(out).st_mode
    except FileNotFoundError:
        return
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode)):
        raise OutputError(
            f"is {kind_of(mode)}; --force replaces only a regular file, a directory or a link", path=str(out)
        )


def _rename(tmp: Path, out: Path, *, force: bool) -> None:
    if not force:
        try:
            _rename_no_replace(tmp, out)
        except FileExistsError:
            remedy = Remedy("force", note=" to replace it")
            raise OutputError("appeared while the copy was written", path=out, remedy=remedy) from None
        return
    refuse_to_replace(out)
    if not (out.exists() or out.is_symlink()):
        os.replace(tmp, out)
        return
    parent = Path(os.path.abspath(out)).parent
    backup = parent / f".{out.name}.optim-repair-old-{os.urandom(4).hex()}"
    backup.mkdir()
    displaced = backup / out.name
    os.replace(out, displaced)
    try:
        os.replace(tmp, out)
    except OSError:
        os.replace(displaced, out)
        raise
    finally:
        remove(backup)
