"""The ``optim-repair`` console entry point: Ctrl-C and SIGTERM become exit codes from the first moment.

This module imports nothing but ``signal`` and ``sys`` before the handlers are in place, and the rest
of optim-repair only after, so that an interrupt while Python is still loading the command prints one
line and exits 130 (143 for SIGTERM), never a traceback.
"""

from __future__ import annotations

import signal
import sys

INTERRUPTED, TERMINATED = 130, 143  # optim_repair.errors.ExitCode, not imported yet


def _terminate(signum: int, frame: object) -> None:
    from optim_repair.errors import Terminated

    raise Terminated


_swallowed: list[BaseException] = []


def _interrupted_while_importing(unraisable: sys.UnraisableHookArgs) -> None:
    """Python swallows, and prints with its traceback, a KeyboardInterrupt that lands in one of its
    import-lock callbacks; remember it instead, and honour it once the imports are done."""
    if isinstance(unraisable.exc_value, KeyboardInterrupt):
        _swallowed.append(unraisable.exc_value)
    else:
        sys.__unraisablehook__(unraisable)


def _exit(message: str, code: int) -> None:
    sys.stderr.write(f"optim-repair: error: {message}\n")
    sys.exit(code)


def main() -> None:
    signal.signal(signal.SIGTERM, _terminate)
    sys.unraisablehook = _interrupted_while_importing
    try:
        from optim_repair.cli import run
        from optim_repair.errors import Terminated
    except KeyboardInterrupt:
        _exit("interrupted; nothing was written", INTERRUPTED)
    except BaseException as exc:  # Terminated, while its class was being imported
        if type(exc).__name__ != "Terminated":
            raise
        _exit("terminated; nothing was written", TERMINATED)
    finally:
        sys.unraisablehook = sys.__unraisablehook__
    if _swallowed:
        _exit("interrupted; nothing was written", INTERRUPTED)
    del Terminated  # imported above only so that the handler's own import is instant
    run()
