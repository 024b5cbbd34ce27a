"""Write a repaired, verified copy beside the original, atomically.

Everything is written into a temporary sibling of ``--out``, verified from disk, and only then
renamed into place. Any failure, an interrupt or a full disk included, removes the temporary
copy; the input is only ever opened for reading.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from optim_repair.checkpoint import relative, walk_files
from optim_repair.errors import OutputError
from optim_repair.formats import dcp
from optim_repair.formats.torchfile import write_torch_file
from optim_repair.inventory import CheckpointInventory
from optim_repair.repair import RepairPlan
from optim_repair.verify import NOTHING, Verification, verify_copied_file, verify_torch_file

Progress = Callable[[str], None]


def check_output(source: Path, out: Path, *, force: bool) -> None:
    """Refuse an ``--out`` that would lose or overwrite anything it should not."""
    src, dst = source.resolve(), out.resolve()
    if dst == src or src in dst.parents:
        raise OutputError(f"{out}: --out must not be the input or inside it")
    if dst in src.parents:
        raise OutputError(f"{out}: --out must not contain the input")
    if out.exists() or out.is_symlink():
        if not force:
            raise OutputError(f"{out}: already exists; pass --force to replace it")
        if out.is_dir() != source.is_dir():
            raise OutputError(f"{out}: exists and is not a {'directory' if source.is_dir() else 'file'}")
    if not dst.parent.is_dir():
        raise OutputError(f"{out.parent}: no such directory for --out")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _describe(exc: OSError) -> str:
    if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
        return "the disk is full"
    return exc.strerror or str(exc)


def _write_file(
    src: Path, dest: Path, rel: str, plan: RepairPlan, inventory: CheckpointInventory
) -> Verification:
    source = rel or str(src)
    additions = plan.for_file(rel)
    if any(f.file == rel for f in inventory.files):
        write_torch_file(src, source, additions, dest)
        return verify_torch_file(src, dest, source, additions)
    shutil.copyfile(src, dest)
    return verify_copied_file(src, dest, source)


def _write_directory(
    root: Path, tmp: Path, plan: RepairPlan, inventory: CheckpointInventory, *, link: bool, progress: Progress
) -> Verification:
    dcp_roots = [root / f.file if f.file else root for f in inventory.files if f.format == "dcp"]
    total = NOTHING
    for directory in dcp_roots:
        rel = relative(directory, root)
        target = tmp / rel if rel else tmp
        target.mkdir(parents=True, exist_ok=True)
        progress(f"writing {rel or 'DCP checkpoint'}")
        additions = plan.for_file(rel)
        dcp.write_dcp(directory, additions, target, link=link)
        total += dcp.verify_dcp(directory, target, additions)
    for current, subdirectories, _ in os.walk(root):
        for name in subdirectories:
            source = Path(current) / name
            target = tmp / relative(source, root)
            if source.is_symlink():  # os.walk does not descend into it: keep the link, as cp -R does
                if not (target.exists() or target.is_symlink()):
                    os.symlink(os.readlink(source), target)
            else:
                target.mkdir(parents=True, exist_ok=True)
    for file in walk_files(root):
        if any(directory == file.parent or directory in file.parents for directory in dcp_roots):
            continue
        rel = relative(file, root)
        if file.is_symlink() and not any(f.file == rel for f in inventory.files):
            os.symlink(os.readlink(file), tmp / rel)  # a link (even a dangling one) stays a link
            continue
        if plan.for_file(rel):
            progress(f"writing {rel}")
        total += _write_file(file, tmp / rel, rel, plan, inventory)
    return total


def write_copy(
    inventory: CheckpointInventory,
    plan: RepairPlan,
    out: Path,
    *,
    force: bool = False,
    link: bool = False,
    progress: Progress = lambda message: None,
) -> Verification:
    """Write the repaired copy of ``inventory.path`` to ``out`` and verify it; return what was proven."""
    source = Path(inventory.path)
    check_output(source, out, force=force)
    parent = out.resolve().parent
    prefix = f".{out.name}.optim-repair-"
    tmp = _temporary_sibling(parent, prefix, directory=inventory.is_directory)
    try:
        if inventory.is_directory:
            verification = _write_directory(source, tmp, plan, inventory, link=link, progress=progress)
        else:
            progress(f"writing {out}")
            verification = _write_file(source, tmp, "", plan, inventory)
        _move_into_place(tmp, out)
    except OSError as exc:
        _remove(tmp)
        raise OutputError(f"{out}: cannot write ({_describe(exc)}); nothing was left behind") from None
    except BaseException:
        _remove(tmp)
        raise
    return verification


def _temporary_sibling(parent: Path, prefix: str, *, directory: bool) -> Path:
    """A new temporary path beside ``--out``, with the permissions a plain create would give."""
    umask = os.umask(0)
    os.umask(umask)
    try:
        if directory:
            tmp = Path(tempfile.mkdtemp(dir=parent, prefix=prefix))
            tmp.chmod(0o777 & ~umask)
        else:
            handle, name = tempfile.mkstemp(dir=parent, prefix=prefix)
            os.close(handle)
            tmp = Path(name)
            tmp.chmod(0o666 & ~umask)
    except OSError as exc:
        raise OutputError(f"{parent}: cannot write ({_describe(exc)})") from None
    return tmp


def _move_into_place(tmp: Path, out: Path) -> None:
    if not (out.exists() or out.is_symlink()):
        os.replace(tmp, out)
        return
    backup = Path(tempfile.mkdtemp(dir=out.resolve().parent, prefix=f".{out.name}.optim-repair-old-"))
    displaced = backup / out.name
    os.replace(out, displaced)
    try:
        os.replace(tmp, out)
    except OSError:
        os.replace(displaced, out)
        raise
    finally:
        _remove(backup)
