"""The progress bar on stderr while ``fix`` writes, syncs and verifies a copy: one row per stage as it starts."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from rich import filesize
from rich.progress import BarColumn, DownloadColumn, ProgressColumn, Task, TaskID, TextColumn
from rich.progress import Progress as RichProgress
from rich.text import Text

from optim_repair.progress import Progress, Step, ignore
from optim_repair.render.terminal import Screen

SHOW_PROGRESS_FROM = 256 << 20
"""Copies smaller than this are over too soon for a progress bar to help."""

_BINARY_UNITS = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]
_STAGE_LABELS = {"write": "writing", "sync": "syncing", "verify": "verifying"}
ECHO_ROOM = 3
"""Columns the rows leave free at their end, where the terminal echoes Ctrl-C as ``^C``: in a row as wide as the
terminal that echo would wrap onto a line of its own, and clearing the rows on the way out would leave the first."""
SETTLE_SECONDS = 2.0
"""How long a stage runs before its rate and time left are shown: the first readings are noise."""


class BinarySpeed(ProgressColumn):
    """The rate in the units the byte counts use (MiB/s beside GiB), once the stage has settled; none for a stage
    added with ``rate=False``."""

    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        unsettled = not task.finished and task.elapsed is not None and task.elapsed < SETTLE_SECONDS
        if speed is None or unsettled or not task.fields.get("rate", True):
            return Text("", style="progress.data.speed")
        unit, suffix = filesize.pick_unit_and_suffix(int(speed), _BINARY_UNITS, 1024)
        return Text(f"{speed / unit:.1f} {suffix}/s", style="progress.data.speed")


class TimeLeft(ProgressColumn):
    """The time left, shown once the stage has settled (``-:--:--`` before, never a wild first estimate)."""

    def render(self, task: Task) -> Text:
        if task.finished:
            return Text("done", style="progress.elapsed")
        remaining = task.time_remaining
        if remaining is None or task.elapsed is None or task.elapsed < SETTLE_SECONDS:
            return Text("-:--:--", style="progress.remaining")
        minutes, seconds = divmod(int(remaining), 60)
        hours, minutes = divmod(minutes, 60)
        return Text(f"{hours:d}:{minutes:02d}:{seconds:02d}", style="progress.remaining")


@contextlib.contextmanager
def progress_bar(screen: Screen, *, show: bool) -> Iterator[Progress]:
    """A progress callback drawing a bar on stderr for each stage as it starts (writing, syncing, verifying:
    bytes, rate, time left), when ``show``, not quiet, stderr is a terminal and the copy is long enough to
    matter; else one that draws nothing."""
    if not (show and not screen.quiet and sys.stderr.isatty()):
        yield ignore
        return
    bars: list[RichProgress] = []
    tasks: dict[str, TaskID] = {}

    def draw(step: Step) -> None:
        if not bars:
            if step.total < SHOW_PROGRESS_FROM:
                return
            console = screen.stderr()
            console.width -= ECHO_ROOM
            bar = RichProgress(
                TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
                BinarySpeed(), TimeLeft(), console=console, transient=True,
            )  # fmt: skip
            bar.start()
            bars.append(bar)
        if step.stage not in tasks:
            for task in tasks.values():  # a stage starts when the one before it is done
                bars[0].update(task, completed=step.total)
            label = f"{_STAGE_LABELS[step.stage]:<9}"  # syncing: bytes made durable come in bursts, at no rate
            tasks[step.stage] = bars[0].add_task(label, total=step.total, rate=step.stage != "sync")
        bars[0].update(tasks[step.stage], completed=step.done)

    try:
        yield draw
    finally:
        for bar in bars:
            bar.stop()
