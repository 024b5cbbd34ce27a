"""What a fix wrote, file by file: each file of the copy rewritten, copied, hard-linked, added or kept a link.

Read from the copy on the disk beside the original it was made from (for a checkpoint in a store, the objects
downloaded), as a diff of the two trees reads them.
"""

from __future__ import annotations

import os
from pathlib import Path

from optim_repair.checkpoint.planning import FinishedPlan
from optim_repair.records.difference import FileChange, How


def _rewritten(rel: str, finished: FinishedPlan) -> bool:
    """Whether the plan writes the file ``rel`` itself: a torch file it changes, a DCP member it replaces."""
    planned = finished.files.get(rel)
    if planned is not None:
        return planned.changes_anything
    for directory, planned in finished.files.items():
        inside = rel[len(directory) + 1 :] if directory else rel
        if (not directory or rel.startswith(f"{directory}/")) and planned.replaces(inside):
            return True
    return False


def _change(rel: str, copy: Path, original: Path, finished: FinishedPlan, linked: How) -> FileChange:
    status = copy.lstat()
    if copy.is_symlink():
        return FileChange(rel, "link", 0)
    if _rewritten(rel, finished):
        return FileChange(rel, "rewritten", status.st_size)
    if not os.path.lexists(original):
        return FileChange(rel, "added", status.st_size)
    if os.path.samestat(status, original.stat()):
        return FileChange(rel, linked, status.st_size)
    return FileChange(rel, "copied", status.st_size)


def copy_changes(original: Path, copy: Path, finished: FinishedPlan, *, downloaded: bool) -> tuple[FileChange, ...]:
    """Every file of ``copy`` (a file, or a directory walked without following links), against ``original``
    (``downloaded``: the objects of a store fetched there, which the copy links to)."""
    linked: How = "downloaded" if downloaded else "hard-linked"
    if not copy.is_dir() or copy.is_symlink():
        return (_change("", copy, original, finished, linked),)
    found = []
    for directory, subdirectories, names in os.walk(copy):
        subdirectories.sort()
        here = Path(directory)
        for name in sorted([*names, *(d for d in subdirectories if (here / d).is_symlink())]):
            rel = (here / name).relative_to(copy).as_posix()
            found.append(_change(rel, here / name, original / rel, finished, linked))
    return tuple(found)
