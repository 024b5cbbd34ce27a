"""The ``optim-repair`` console entry point: every signal that ends a run is handled from its first line to its last.

Its first act, before typer, rich or torch is loaded, is to handle SIGINT, SIGTERM, SIGHUP and SIGQUIT
(``optim_repair.signals``): while Python loads the command, a signal prints one line and exits at once
(130, 143, 129, 131), nothing having been written; once the command runs, it raises ``Stopped``, which
undoes what the run began. A signal that comes before this module's first line (while Python itself
starts) ends the process by the signal, which a shell reports with the same code.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType

from optim_repair import signals


def _stop(signum: int, frame: FrameType | None) -> None:
    from optim_repair.errors import Stopped  # loaded before this handler is installed: instant

    raise Stopped(signum)


def _stop_again(unraisable: sys.UnraisableHookArgs) -> None:
    """Python swallows an exception raised where nothing can catch it (a weakref callback, such as an
    import lock's, or a ``__del__``), and prints it with its traceback; a ``Stopped`` raised there is
    instead sent again as its signal, whose handler then raises it where the run can undo its work."""
    from optim_repair.errors import Stopped

    if isinstance(unraisable.exc_value, Stopped):
        signal.raise_signal(unraisable.exc_value.signum)
    else:
        sys.__unraisablehook__(unraisable)


def _occupy_closed_descriptors() -> None:
    """Open ``/dev/null`` on each of descriptors 0, 1 and 2 that is closed, so that no file optim-repair
    opens gets its number (with stderr closed, a C library's warning would land in the copy). Python has
    already made the stream None; ``cli.boundary`` refuses to run when stdout or stderr is."""
    for descriptor in (0, 1, 2):
        try:
            os.fstat(descriptor)
        except OSError:
            os.open(os.devnull, os.O_RDWR)  # the lowest free number: this one


def main() -> None:
    signals.install(signals.exit_at_once)
    _occupy_closed_descriptors()
    from optim_repair.cli import run

    sys.unraisablehook = _stop_again
    signals.install(_stop)
    run()
