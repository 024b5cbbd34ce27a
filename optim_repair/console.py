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


def main() -> None:
    signal.signal(signal.SIGTERM, _terminate)
    try:
        from optim_repair.cli import run
        from optim_repair.errors import Terminated
    except KeyboardInterrupt:
        sys.stderr.write("optim-repair: error: interrupted; nothing was written\n")
        sys.exit(INTERRUPTED)
    except BaseException as exc:  # Terminated, while its class was being imported
        if type(exc).__name__ != "Terminated":
            raise
        sys.stderr.write("optim-repair: error: terminated; nothing was written\n")
        sys.exit(TERMINATED)
    del Terminated  # imported above only so that the handler's own import is instant
    run()
