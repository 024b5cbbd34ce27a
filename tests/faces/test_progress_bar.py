"""The progress bar: a row per stage as it starts, binary units throughout, no time left before it settles."""

from __future__ import annotations

import io
import os
import pty
import sys
import threading
import time

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


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_each_stage_gets_its_labelled_row_as_it_starts(monkeypatch: pytest.MonkeyPatch) -> None:
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
    monkeypatch.setenv("COLUMNS", "100")
    total = SHOW_PROGRESS_FROM * 4
    with progress_bar(Screen(color="never"), show=True) as draw:
        for stage in ("write", "sync", "verify"):
            for done in (total // 2, total):
                draw(Step(stage, done, total))  # type: ignore[arg-type]
                time.sleep(0.15)
    terminal.flush()
    time.sleep(0.2)
    terminal.close()
    reader.join(timeout=5)
    os.close(leader)
    shown = b"".join(chunks)
    text = shown.decode(errors="replace")
    assert "writing" in text and "syncing" in text and "verifying" in text
    assert "GiB" in text and "MB" not in text and "GB" not in text
    assert text.index("writing") < text.index("syncing") < text.index("verifying")
