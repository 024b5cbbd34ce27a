"""The copy is synced before it is verified and renamed, and its directory after: observed with strace.

The system calls of the real command on a real file system are traced (nothing is mocked): every file
and directory written is fsynced before the rename that puts the copy in place, the directory holding
``--out`` after it, and with ``--no-sync`` nothing is.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.factories import trainers
from tests.factories.support import installed_command

STRACE = shutil.which("strace")
pytestmark = pytest.mark.skipif(STRACE is None, reason="strace is not installed")


def traced(tmp_path: Path, *args: str | Path) -> list[str]:
    log = tmp_path / "strace.log"
    command = [str(STRACE), "-f", "-y", "-e", "trace=fsync,fdatasync,rename,renameat,renameat2", "-o", str(log)]
    result = subprocess.run([*command, *installed_command(), *map(str, args)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return [line for line in log.read_text().splitlines() if "fsync" in line or "rename" in line]


def test_every_written_file_and_directory_is_synced_before_the_rename(tmp_path: Path) -> None:
    built = trainers.hf_trainer(tmp_path / "in")
    out = tmp_path / "out"
    calls = traced(tmp_path, "fix", built.path, "--out", out)
    rename = next(i for i, call in enumerate(calls) if "rename" in call and "optim-repair-tmp-" in call)
    synced = " ".join(calls[:rename])
    for file in built.path.rglob("*"):
        assert re.search(rf"fsync\(\d+<[^>]*optim-repair-tmp-[^>]*/{re.escape(file.name)}>", synced), file.name
    assert re.search(r"fsync\(\d+<[^>]*optim-repair-tmp-[0-9a-f]+>", synced), "the copy's directory"
    assert any("fsync(" in call and f"<{tmp_path}>" in call for call in calls[rename + 1 :]), "out's parent"


def test_no_sync_syncs_nothing(tmp_path: Path) -> None:
    built = trainers.unirl_torch(tmp_path / "in")
    calls = traced(tmp_path, "fix", built.path, "--out", tmp_path / "out", "--no-sync")
    assert not [call for call in calls if "fsync" in call]
