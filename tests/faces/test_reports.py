"""The reports on a terminal: lines wrap between words, and a table too wide for the terminal becomes lines."""

from __future__ import annotations

import os
import pty
import re
import select
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.factories import dcp as dk
from tests.factories import trainers
from tests.factories.support import installed_command

ESCAPES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def on_terminal(cwd: Path, *args: str, columns: int) -> str:
    """The installed command's stdout and stderr as a terminal ``columns`` wide shows them."""
    leader, follower = pty.openpty()
    env = {**os.environ, "COLUMNS": str(columns), "NO_COLOR": "1", "TERM": "xterm"}
    process = subprocess.Popen(
        [*installed_command(), *args], cwd=cwd, stdin=subprocess.DEVNULL, stdout=follower, stderr=follower, env=env
    )
    os.close(follower)
    chunks = []
    while True:
        ready, _, _ = select.select([leader], [], [], 60)
        if not ready:
            break
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the command exited and the terminal closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    process.wait(timeout=60)
    return ESCAPES.sub("", b"".join(chunks).decode()).replace("\r", "")


def piped(cwd: Path, *args: str) -> str:
    """The command's stdout and stderr, each line whole."""
    env = {**os.environ, "COLUMNS": "1000", "NO_COLOR": "1"}
    result = subprocess.run([*installed_command(), *args], cwd=cwd, capture_output=True, text=True, env=env)
    return result.stdout + result.stderr


BOX = "━┃┏┓┗┛┳┻╋┡┩╇│└┘┴─"


def _words(text: str) -> set[str]:
    return {word.strip(":;,()" + BOX) for word in text.split()} - {"", "\\"}


def assert_wrapped_between_words(shown: str, whole: str, columns: int) -> None:
    """Every line fits, and every word shown is a word of the unwrapped report (or a ``header=value`` of a
    table shown as lines, or the backslash that continues the ``next:`` command). The time a run took, which two
    runs measure apart, is no word of either."""
    lines = shown.splitlines()
    assert lines and all(len(line) <= columns for line in lines), [line for line in lines if len(line) > columns]
    assert all(line == line.rstrip() for line in lines), "no trailing blanks"
    took = re.compile(r"\bin\s+\d+\.\d\s+s\b")
    reference = _words(took.sub("", whole))
    words = _words(took.sub("", " ".join(lines)))
    broken = [word for word in words if word not in reference and not re.fullmatch(r"[a-z]+=\S+", word)]
    assert not broken, broken


def test_inspect_wraps_between_words_on_a_narrow_terminal(tmp_path: Path) -> None:
    trainers.hf_trainer(tmp_path / "hf")
    dk.unirl_dcp(tmp_path / "dcp")
    for checkpoint in ("hf/checkpoint-3", "dcp/checkpoint-3"):
        shown = on_terminal(tmp_path, "inspect", checkpoint, columns=50)
        assert_wrapped_between_words(shown, piped(tmp_path, "inspect", checkpoint), 50)
        assert re.search(r"^\S+: keys=\w+ groups=1 params=\d+", shown, re.M), "the table, as one line per row"
        wide = on_terminal(tmp_path, "inspect", checkpoint, columns=120)
        assert "┃ optimizer" in wide or "┃optimizer" in wide, "a table where it fits"
        assert "keys=" not in wide


@pytest.mark.parametrize("columns", [50, 70])
def test_the_fix_summary_wraps_between_words(tmp_path: Path, columns: int) -> None:
    """A long optimizer label (``checkpoint.pt:optimizer_state_dict (adamw)``) is never cut to fit."""
    dk.unirl_dcp(tmp_path / "dcp")
    trainers.unirl_torch(tmp_path / "torch")
    for checkpoint in ("dcp/checkpoint-3", "torch/checkpoint-2"):
        whole = piped(tmp_path, "fix", checkpoint, "--out", "fixed", "--fill", "fresh")
        shutil.rmtree(tmp_path / "fixed")
        shown = on_terminal(tmp_path, "fix", checkpoint, "--out", "fixed", "--fill", "fresh", columns=columns)
        shutil.rmtree(tmp_path / "fixed")
        assert "verified" in shown and "adamw" in shown
        assert_wrapped_between_words(shown, whole, columns)


def test_a_pipe_keeps_each_line_whole(tmp_path: Path) -> None:
    dk.unirl_dcp(tmp_path / "dcp")
    env = {**os.environ, "COLUMNS": "60", "NO_COLOR": "1"}
    out = subprocess.run(
        [*installed_command(), "inspect", "dcp/checkpoint-3"], cwd=tmp_path, capture_output=True, text=True, env=env
    ).stdout
    notice = next(line for line in out.splitlines() if "dcp-missing-key" in line)
    assert notice.endswith("the default for DCP)"), "one notice, one line, for grep"


def test_inspect_at_80_columns_fits_hangs_its_notices_and_ends_with_the_fix_to_run(tmp_path: Path) -> None:
    """The table drops the finding columns that are zero in every row, a wrapped notice hangs under its first line,
    and a repairable report ends with the one command that repairs it, which does."""
    trainers.unirl_torch(tmp_path / "torch")
    shown = on_terminal(tmp_path, "inspect", "torch/checkpoint-2", columns=80)
    lines = shown.rstrip("\n").splitlines()
    assert all(len(line) <= 80 for line in lines), [line for line in lines if len(line) > 80]
    (header,) = [line for line in lines if "optimizer" in line and "┃" in line]
    assert "missing" in header and "empty" not in header and "malformed" not in header
    notice = next(i for i, line in enumerate(lines) if "stock-loader-phantom-step" in line)
    assert lines[notice].startswith("  stock-loader-phantom-step ")
    assert re.match(r"    \S", lines[notice + 1]), "a wrapped notice hangs under its first line"
    command = "optim-repair fix torch/checkpoint-2 --out torch/checkpoint-2-fixed"
    assert [line for line in lines if line.startswith("next:")] == [f"next: {command}"]
    assert lines[-1] == f"next: {command}"
    fixed = subprocess.run([*installed_command(), *command.split()[1:]], cwd=tmp_path, capture_output=True, text=True)
    assert fixed.returncode == 0, fixed.stderr
    healthy = piped(tmp_path, "inspect", "torch/checkpoint-2-fixed")
    assert ": healthy" in healthy and "next:" not in healthy


def test_a_run_directory_says_each_notice_once_naming_its_steps(tmp_path: Path) -> None:
    trainers.unirl_torch(tmp_path / "run")
    shutil.copytree(tmp_path / "run" / "checkpoint-2", tmp_path / "run" / "checkpoint-4")
    lines = piped(tmp_path, "inspect", "run").splitlines()
    steps = "in checkpoint-2/checkpoint.pt:optimizer_state_dict, checkpoint-4/checkpoint.pt:optimizer_state_dict:"
    for code in ("missing", "stock-loader-phantom-step", "fsdp1-loader"):
        (line,) = [line for line in lines if line.lstrip().startswith(f"{code} ")]
        assert line.startswith(f"  {code} {steps} "), line
