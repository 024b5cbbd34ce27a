"""The signals that end a run, their exit codes, and holding them while a step must not be cut in two.

SIGINT (Ctrl-C), SIGTERM, SIGHUP (the terminal closed) and SIGQUIT (Ctrl-\\) end a run with exit 128 plus
the signal's number, after what the run began is undone. The console handles them from its first line
(``install``): while Python still loads optim-repair, with ``exit_at_once``, since nothing can have been
written yet; once the command runs, by raising ``errors.Stopped``, so that the temporary copy is removed on
the way out. This module imports only what Python's own start-up has loaded, so that the console can install
the first handler before anything else is loaded.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterator
from types import FrameType

ENDING: dict[int, tuple[str, str]] = {
    signal.SIGINT: ("interrupted", "interrupted"),
    signal.SIGTERM: ("terminated", "terminated"),
    signal.SIGHUP: ("hung-up", "hung up (the terminal closed)"),
    signal.SIGQUIT: ("quit", "quit (SIGQUIT)"),
}
"""The signals that end a run, each with its JSON ``error.code`` and what the one-line error says."""

Handler = Callable[[int, "FrameType | None"], None]
_installed: set[Handler] = set()


def install(handler: Handler) -> None:
    """Handle every ending signal with ``handler``: the console does, from its first line to its last."""
    _installed.add(handler)
    for signum in ENDING:
        signal.signal(signum, handler)


def exit_at_once(signum: int, frame: FrameType | None) -> None:
    """The handler while optim-repair is still being loaded: nothing is written yet, so say so and exit.

    Raising instead could land inside an import and leave a module half made (a traceback, exit 1)."""
    with contextlib.suppress(OSError):
        os.write(2, f"optim-repair: error: {ENDING[signum][1]}; nothing was written\n".encode())
    os._exit(128 + signum)


@contextlib.contextmanager
def held() -> Iterator[None]:
    """The ending signals wait while the block runs, and are handled once it ends: for a step that a
    handler raising in its middle would leave half done (a temporary created but not yet recorded).

    A mask is a thread's own, and Python runs a handler in the main thread whichever thread the kernel gave the
    signal to: so every thread a run starts is started inside this block, inherits the mask, and never takes an
    ending signal, which then waits for the main thread's mask alone."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, ENDING)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def settle() -> None:
    """The run's outcome is decided and its output written: from here to the process's exit, the ending
    signals wait (and are dropped with it), so that none can turn a finished run into a failed one.

    Only where ``install`` handled them (the console), never in a program that embeds the commands."""
    if signal.getsignal(signal.SIGTERM) in _installed:
        signal.pthread_sigmask(signal.SIG_BLOCK, ENDING)
