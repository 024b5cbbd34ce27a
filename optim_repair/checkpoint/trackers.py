"""A run's tracker: the file in which its library names the last step it saved, read to say when it disagrees.

``--latest`` takes the newest complete step by its name and content. A tracker that names another step (one still
being written, one gone, an older one) is worth a line: a resume script that follows the tracker would take it.
"""

from __future__ import annotations

import os
from pathlib import Path

from optim_repair.records.steps import TRACKERS, step_number, tracked_step

_TRACKER_LIMIT = 4096
"""The most of a tracker read: a step's name."""


def _tracked(run: Path) -> tuple[str, str] | None:
    """The tracker of the run directory ``run`` and the step it names, or None."""
    for tracker in TRACKERS:
        path = run / tracker
        if path.is_symlink():
            named = os.path.basename(os.path.normpath(os.readlink(path)))
            return (tracker, named) if tracked_step(tracker, named) else None
        if path.is_file():
            try:
                with path.open("rb") as stream:
                    text = stream.read(_TRACKER_LIMIT).decode("utf-8", "replace")
            except OSError:
                return None
            step = tracked_step(tracker, text)
            return (tracker, step) if step else None
    return None


def tracker_disagrees(run: Path, chosen: Path) -> str | None:
    """What to say when the run's tracker names another step than ``chosen``, its newest complete one."""
    found = _tracked(run)
    if found is None or found[1] == chosen.name:
        return None
    tracker, step = found
    if not (run / step).exists():
        state = "missing"
    elif (step_number(step) or (0, 0)) < (step_number(chosen.name) or (0, 0)):
        state = "older"
    else:
        state = "not complete"
    return f"the run's tracker {tracker} names {step}, which is {state}: taking {chosen.name}, the newest complete step"
