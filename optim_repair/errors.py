"""The one exception tree of optim-repair.

Every error a user can cause is an ``OptimRepairError``; its class carries the process exit
code, and the CLI maps it to a one-line message in exactly one place.
"""

from __future__ import annotations


class ExitCode:
    """Exit codes are part of the interface: documented in the README and docs/."""

    OK = 0
    REPAIRABLE = 1
    USAGE = 2
    MALFORMED = 3
    INPUT = 4
    OUTPUT = 5
    INTERRUPTED = 130
    """Interrupted (Ctrl-C); nothing was written."""
    INTERNAL = 70
    """A bug in optim-repair (EX_SOFTWARE), never an input problem."""


class OptimRepairError(Exception):
    """Base of every error optim-repair reports to a user."""

    exit_code = ExitCode.INPUT


class UsageError(OptimRepairError):
    """The command line asks for something contradictory or impossible."""

    exit_code = ExitCode.USAGE


class InputError(OptimRepairError):
    """The input is missing, unreadable, not a checkpoint, or holds no optimizer state."""

    exit_code = ExitCode.INPUT


class NotATorchFile(InputError):
    """The file is not a torch file at all (no zip archive with data.pkl, no legacy magic number)."""


class UnsafeInputError(InputError):
    """The input would run code (or import a non-allowlisted global) if loaded."""


class RepairRefused(OptimRepairError):
    """The checkpoint cannot be repaired as asked: it is malformed, or a fill cannot be built."""

    exit_code = ExitCode.MALFORMED


class OutputError(OptimRepairError):
    """The output was refused or could not be written or verified; nothing was left behind."""

    exit_code = ExitCode.OUTPUT


class VerificationError(OutputError):
    """The written copy does not match the original where it must."""
