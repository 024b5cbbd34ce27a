"""How far a fix has come, in bytes: the library reports it through a callback, the CLI draws it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

Stage = Literal["write", "sync", "verify"]
"""``write``: bytes written into the copy; ``sync``: bytes of it made durable (with sync on); ``verify``: bytes
read back and compared."""


@dataclass(frozen=True)
class Step:
    """Bytes of one stage done so far, of the stage's total (both known from the start)."""

    stage: Stage
    done: int
    total: int


Progress = Callable[[Step], None]
Notice = Callable[[str], None]
"""A line of text for the user (``writing checkpoint.pt``, a stale temporary removed): stderr in the CLI."""


def ignore(step: Step) -> None:
    """The progress callback of a caller that shows none."""


def silent(message: str) -> None:
    """The notice callback of a caller that shows none."""


@dataclass(frozen=True)
class Reporter:
    """Where the library reports while it works (as pypa/build injects its logger): progress, and notices."""

    progress: Progress = ignore
    notice: Notice = silent


class Meter:
    """Counts the bytes each stage has done and reports every advance to a ``Progress`` callback."""

    def __init__(self, progress: Progress, total: int) -> None:
        self._progress = progress
        self._total = total
        self._done: dict[Stage, int] = {"write": 0, "sync": 0, "verify": 0}

    def advance(self, stage: Stage, nbytes: int) -> None:
        self._done[stage] = min(self._done[stage] + nbytes, self._total)
        self._progress(Step(stage, self._done[stage], self._total))

    def writing(self, nbytes: int) -> None:
        self.advance("write", nbytes)

    def syncing(self, nbytes: int) -> None:
        self.advance("sync", nbytes)

    def verifying(self, nbytes: int) -> None:
        self.advance("verify", nbytes)


QUIET = Reporter()
"""The reporter of a caller that shows nothing."""
