"""The temporary sibling of --out (``optim_repair.storage.disk_staging``): atomic creation, links, stale temporaries."""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

import pytest

from optim_repair.errors import OutputError
from optim_repair.storage import disk_staging as staging
from tests.conftest import run_cli
from tests.factories import defects
from tests.factories.support import fix, leftovers


@pytest.mark.parametrize("directory", [False, True], ids=["file", "directory"])
def test_without_force_an_out_that_appears_meanwhile_is_never_replaced(tmp_path: Path, directory: bool) -> None:
    out = tmp_path / "out"
    with staging.temporary_sibling(out, directory=directory) as tmp:
        if directory:
            (tmp / "mine").write_text("mine")
            out.mkdir()
            (out / "theirs").write_text("another run's")
        else:
            tmp.write_text("mine")
            out.write_text("another run's")
        with pytest.raises(OutputError, match="appeared while the copy was written; pass force=True"):
            staging.move_into_place(tmp, out, force=False)
    assert (out / "theirs" if directory else out).read_text() == "another run's"
    assert not list(tmp_path.glob(".out.optim-repair-*"))


def test_a_copy_moved_into_place_is_recorded_and_kept_when_its_run_fails_after(tmp_path: Path) -> None:
    """What the command line runs each command in: a copy renamed into place is recorded, and stays where it is
    when the run then fails (the summary cannot be printed, a signal comes); outside one, nothing is recorded."""
    built = defects.healthy(tmp_path / "in")
    failed, ended, library = tmp_path / "failed.pt", tmp_path / "ended.pt", tmp_path / "library.pt"
    with pytest.raises(BrokenPipeError), staging.recorded_placements() as placed:
        fix(built.path, failed)
        assert failed.is_file() and placed == [failed]
        raise BrokenPipeError
    assert failed.is_file() and leftovers(failed) == []
    with staging.recorded_placements() as placed:
        fix(built.path, ended)
    assert ended.is_file() and placed == [ended]
    fix(built.path, library)
    assert library.is_file()
    assert staging._recording == []


def test_force_replaces_a_dangling_link_beside_it_not_at_its_target(tmp_path: Path) -> None:
    built = defects.healthy(tmp_path / "in")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = tmp_path / "out.pt"
    out.symlink_to(elsewhere / "absent.pt")
    fix(built.path, out, force=True)
    assert out.is_file() and not out.is_symlink()
    assert list(elsewhere.iterdir()) == []


def test_a_stale_temporary_is_removed_and_a_live_one_kept(tmp_path: Path) -> None:
    built = defects.healthy(tmp_path / "in")
    out = tmp_path / "out.pt"
    stale, live = tmp_path / ".out.pt.optim-repair-tmp-00000000", tmp_path / ".out.pt.optim-repair-tmp-11111111"
    for path in (stale, live):
        path.write_bytes(b"partial")
        os.utime(path, (time.time() - 3600, time.time() - 3600))
    with live.open("rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as a run that is still writing holds it
        result = run_cli(["fix", built.path, "--out", out])
        assert live.exists() and not stale.exists()
    assert f"removed {stale}, a temporary copy left by a run that was killed" in result.stderr
    assert out.is_file()
