"""The progress bar: a row per stage as it starts, binary units throughout, no time left before it settles."""

from __future__ import annotations

import contextlib
import io
import os
import pty
import re
import sys
import threading
import time
from collections.abc import Iterator
from typing import TextIO

import pytest
from rich.console import Console
from rich.progress import Progress

from optim_repair.progress import Step
from optim_repair.render import Screen, progress_bar
from optim_repair.render.progress_bar import SETTLE_SECONDS, SHOW_PROGRESS_FROM, BinarySpeed, TimeLeft

GIB = 1 << 30


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _task(clock: Clock) -> tuple[Progress, int]:
    bar = Progress(console=Console(file=io.StringIO()), get_time=clock)
    return bar, bar.add_task("writing", total=2 * GIB)


def test_no_rate_or_time_left_before_the_stage_settles() -> None:
    clock = Clock()
    bar, task = _task(clock)
    clock.now += 0.01
    bar.update(task, completed=1 << 20)  # a first reading: 1 MiB in 10 ms would say 20 s, or 10 hours
    clock.now += 0.01
    bar.update(task, completed=(1 << 20) + 4096)
    shown = bar.tasks[0]
    assert TimeLeft().render(shown).plain == "-:--:--"
    assert BinarySpeed().render(shown).plain == ""
    clock.now += SETTLE_SECONDS
    bar.update(task, completed=GIB)
    settled = bar.tasks[0]
    assert TimeLeft().render(settled).plain != "-:--:--"
    speed = BinarySpeed().render(settled).plain
    assert speed.endswith("MiB/s"), "the rate in binary units, as the byte counts are"
    bar.update(task, completed=2 * GIB)
    assert TimeLeft().render(bar.tasks[0]).plain == "done"


@contextlib.contextmanager
def _terminal(monkeypatch: pytest.MonkeyPatch, columns: int) -> Iterator[tuple[TextIO, list[bytes]]]:
    """stderr as a pseudo-terminal ``columns`` wide, and what was written to it, complete once the block ends."""
    leader, follower = pty.openpty()
    chunks: list[bytes] = []

    def read() -> None:  # drain the terminal while the bar draws, so that its writes never block
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:
                return
            if not chunk:
                return
            chunks.append(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    terminal = os.fdopen(follower, "w", encoding="utf-8")
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.setenv("COLUMNS", str(columns))
    try:
        yield terminal, chunks
    finally:
        terminal.flush()
        time.sleep(0.2)
        terminal.close()
        reader.join(timeout=5)
        os.close(leader)


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_each_stage_gets_its_labelled_row_as_it_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    total = SHOW_PROGRESS_FROM * 4
    with _terminal(monkeypatch, 100) as (_, chunks), progress_bar(Screen(color="never"), show=True) as draw:
        for stage in ("write", "sync", "verify"):
            for done in (total // 2, total):
                draw(Step(stage, done, total))  # type: ignore[arg-type]
                time.sleep(0.15)
    shown = b"".join(chunks)
    text = shown.decode(errors="replace")
    assert "writing" in text and "syncing" in text and "verifying" in text
    assert "GiB" in text and "MB" not in text and "GB" not in text
    assert text.index("writing") < text.index("syncing") < text.index("verifying")


def _screen(shown: str, columns: int) -> list[str]:
    """What a terminal ``columns`` wide shows once ``shown`` is written to it: a line that fills the width wraps at
    the next character; carriage return, newline, cursor up, erase line; other controls draw nothing."""
    rows: dict[int, list[str]] = {}
    row = column = 0
    for token in re.findall(r"\x1b\[[0-9;?]*[A-Za-z]|[\r\n]|[^\x1b\r\n]", shown):
        if token == "\r":
            column = 0
        elif token == "\n":
            row += 1
        elif token.endswith("A"):
            row = max(row - int(token[2:-1] or 1), 0)
        elif token == "\x1b[2K":
            rows[row] = []
        elif not token.startswith("\x1b"):
            if column == columns:
                row, column = row + 1, 0
            line = rows.setdefault(row, [])
            line.extend(" " * (column + 1 - len(line)))
            line[column] = token
            column += 1
    return ["".join(rows[place]).rstrip() for place in sorted(rows) if "".join(rows[place]).strip()]


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_ctrl_c_while_verifying_leaves_no_row_behind_and_syncing_shows_no_rate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The terminal echoes Ctrl-C as ``^C`` where the cursor is, at the end of the last row: a row as wide as the
    terminal wraps it onto a line of its own, and clearing the bar's rows would then leave its first one."""
    total = SHOW_PROGRESS_FROM * 4
    bar = progress_bar(Screen(color="never"), show=True)
    with _terminal(monkeypatch, 80) as (terminal, chunks), pytest.raises(KeyboardInterrupt), bar as draw:
        for stage in ("write", "sync", "verify"):
            for done in (total // 2, total):
                if (stage, done) == ("verify", total):
                    time.sleep(0.3)  # the bar redraws its rows
                    terminal.write("^C")  # the terminal's echo
                    terminal.flush()
                    raise KeyboardInterrupt
                draw(Step(stage, done, total))  # type: ignore[arg-type]
                time.sleep(0.15)
    shown = b"".join(chunks).decode(errors="replace")
    syncing = [line for line in re.split(r"[\r\n]", re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", shown)) if "syncing" in line]
    assert syncing and all("done" in line or "-:--:--" in line for line in syncing)
    assert not any("/s" in line for line in syncing), "no rate for syncing: the bytes come in bursts"
    assert [line for line in _screen(shown, 80) if line != "^C"] == [], _screen(shown, 80)
